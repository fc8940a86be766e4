from memrt.cli import main

raise SystemExit(main())
