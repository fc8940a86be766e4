#!/usr/bin/env bash
# memrt's two commands, each doing its own set-up in ./.venv on first use:
#   bash dev.sh demo   - the main job (memrt demo: stock vs memrt, side by side)
#   bash dev.sh test   - the whole test suite, one test at a time (what CI runs)
# Extra arguments go to the command (e.g. bash dev.sh test -k config). bash dev.sh test -n 2 --dist loadfile
# runs it on 2 workers (tests marked alone run with nothing beside them): faster, but tests that measure
# speeds (balance shares) can fail beside another test on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")"
cmd="${1:-}"; shift || true
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    # Without a GPU, take the CPU wheel (never the multi-GB CUDA build).
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install -q torch
    else
        "$PY" -m pip install -q torch==2.13.0 || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
stamp="$VENV/.memrt-installed"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
    "$PY" -m pip install -q -e ".[test,plot]"
    touch "$stamp"
fi
case "$cmd" in
    test) exec "$PY" -m pytest -q tests "$@" ;;
    demo) exec "$VENV/bin/memrt" demo "$@" ;;
    info) exec "$VENV/bin/memrt" info "$@" ;;
    *) echo "usage: bash dev.sh {demo|test|info} [args...]" >&2; exit 2 ;;
esac
