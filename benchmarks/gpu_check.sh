#!/usr/bin/env bash
# memrt's CUDA checks for a lent GPU, one script, < 10 minutes:
#   planner certification (CUDA allocator stats), CUDA frontier incl. save_on_cpu, host-tier offload
#   overlap, hierarchical all-reduce with CUDA tensors (NCCL, else gloo; correctness only).
# Usage (repository root):  bash benchmarks/gpu_check.sh [OUT_DIR]     (default: $OUT, else ./gpu-check)
# Without a CUDA device it prints "no CUDA device" and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DIR=${1:-${OUT:-gpu-check}}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device: nothing to check (run this on a machine with a GPU)"
  exit 0
fi
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$DIR/nvidia-smi.csv" 2>&1 || true
# 540 s hard limit so the whole script stays under 10 minutes even if a check hangs
timeout --kill-after=20 540 "$PY" -m benchmarks.gpu_check --out "$DIR" 2>&1 | tee "$DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
