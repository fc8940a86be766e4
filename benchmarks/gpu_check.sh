#!/usr/bin/env bash
# memrt's device check for a lent GPU (no network): one run (390 s deadline, hard kill <= 420 s), one JSON + one text table.
#   bash benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]      (OUT_DIR default: $OUT, else ./gpu-check)
# Python: $PYTHON, else .venv/bin/python, python3, python -- the first that imports torch. memrt is
# installed offline against that torch (pip --no-deps --no-build-isolation --no-index --use-pep517 -e .).
# Exit: 0 when no row FAILs; 1 on a FAIL (incl. no CUDA device, except with --dry-run); 3 when no python
# has torch; 124/137 when the hard time limit cut the run (the JSON keeps every row finished before).
# Rows and figures: benchmarks/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
DRY=()
DIR=""
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=(--dry-run) ;;
    -*) echo "gpu_check.sh: unknown option $a (expected --dry-run and an output folder)" >&2; exit 2 ;;
    *) DIR="$a" ;;
  esac
done
DIR=${DIR:-${OUT:-gpu-check}}
LIMIT=${GPU_CHECK_LIMIT_S:-390}     # the python run's own deadline; the hard kill below adds 15 s (<= 420 s)
if [ "$LIMIT" -gt 405 ] 2>/dev/null; then LIMIT=405; fi
mkdir -p "$DIR" || exit 3

PY=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$c" ] || continue
  command -v "$c" >/dev/null 2>&1 || continue
  if "$c" -c 'import torch' >/dev/null 2>&1; then PY="$c"; break; fi
done
if [ -z "$PY" ]; then
  msg="no python with torch found (tried \$PYTHON, .venv/bin/python, python3, python)"
  echo "FAIL  environment: $msg" >&2
  printf '{"status": "FAIL", "rows": [{"name": "environment", "status": "FAIL", "reason": "%s"}]}\n' "$msg" \
    > "$DIR/gpu_check.json"
  printf 'environment  FAIL  %s\n' "$msg" > "$DIR/gpu_check.txt"
  exit 3
fi
echo "gpu_check: python $PY, output $DIR, limit ${LIMIT}s" >&2
timeout --kill-after=5 $((LIMIT + 10)) "$PY" -m benchmarks.gpu_check --out "$DIR" --limit "$LIMIT" ${DRY[@]+"${DRY[@]}"}
rc=$?
[ -f "$DIR/gpu_check.txt" ] && cat "$DIR/gpu_check.txt"
exit $rc
