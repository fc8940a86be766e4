"""Run tests of PyTorch's own distributed suite with its ``dist`` pointed at torch.distributed or memrt.comm.

The suite (``torch.testing._internal.distributed.distributed_test``, shipped in the torch wheel) is
driven as PyTorch's ``test/distributed/test_distributed_spawn.py`` drives it: environment ``BACKEND``,
``WORLD_SIZE``, ``TEMP_DIR`` (``INIT_METHOD`` defaults to env://; each test uses a file rendezvous),
one fresh set of WORLD_SIZE processes per test. Processes are forked (this runner never initializes a
process group itself), which saves re-importing torch per test.

    BACKEND=gloo WORLD_SIZE=4 TEMP_DIR=$(mktemp -d) MEMRT_TOPOLOGY="0,1;2,3" \
        python tests/scripts/torch_dist_suite.py --via memrt --out results.json test_all_reduce_sum ...

Writes ``{"via": ..., "results": {test name: {"outcome": pass|skip|fail|error, "detail": ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import unittest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--via", choices=("torch", "memrt"), required=True, help="what the suite's `dist` is")
    ap.add_argument("--out", required=True, help="JSON file of outcomes")
    ap.add_argument("--list", action="store_true", help="print the suite's test names and exit")
    ap.add_argument("names", nargs="*", help="test names of DistributedTest._DistTestBase")
    args = ap.parse_args(argv)

    from torch.testing._internal.distributed import distributed_test as dt

    if args.list:
        print("\n".join(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_")))
        return 0
    if args.via == "memrt":
        import memrt.comm

        dt.dist = memrt.comm  # the suite calls dist.<name>(...): every call now goes through memrt.comm

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            import torch.multiprocessing as mp

            self._start_processes(mp.get_context("fork").Process)

    results: dict[str, dict[str, str]] = {}

    class Collect(unittest.TextTestResult):
        def addSuccess(self, test):  # noqa: N802 - unittest's names
            super().addSuccess(test)
            results[test._testMethodName] = {"outcome": "pass", "detail": ""}

        def addSkip(self, test, reason):  # noqa: N802
            super().addSkip(test, reason)
            results[test._testMethodName] = {"outcome": "skip", "detail": str(reason)}

        def addFailure(self, test, err):  # noqa: N802
            super().addFailure(test, err)
            results[test._testMethodName] = {"outcome": "fail", "detail": self._exc_info_to_string(err, test)}

        def addError(self, test, err):  # noqa: N802
            super().addError(test, err)
            name = getattr(test, "_testMethodName", str(test))
            results[name] = {"outcome": "error", "detail": self._exc_info_to_string(err, test)}

    suite = unittest.TestSuite(Suite(n) for n in args.names)
    unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Collect).run(suite)
    with open(args.out, "w") as f:
        json.dump({"via": args.via, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
