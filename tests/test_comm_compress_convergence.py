"""The int8 and bf16 versions of a DDP job whose gradients have all-zero rows end at stock's loss.

The job of ``benchmarks/convergence_int8.py --job sparse-rows``, small: GPT with tied embeddings, a
vocabulary of 1024 and inputs from 64 of its tokens (most embedding rows get all-zero gradients through
the input, vanishing ones through the tied head), AdamW; 4 ranks, 2 fake nodes x 2 on loopback, so
memrt's DDP hook compresses the inter-node hop (int8 with error feedback per bucket, bf16). The full
200-step version: ``.venv/bin/python -m benchmarks.convergence_int8 --job sparse-rows``.
"""

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = 40
TAIL = 5


@pytest.mark.slow
def test_sparse_rows_job_int8_and_bf16_end_within_one_percent_of_stock():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.convergence_int8 import run

    res = run(STEPS, True, "sparse-rows")
    exact = sum(res["exact"]["losses"][-TAIL:]) / TAIL
    assert res["exact"]["losses"][-1] < res["exact"]["losses"][0] * 0.5  # the job learns
    for arm in ("int8", "bf16"):
        losses = res[arm]["losses"]
        assert all(math.isfinite(v) for v in losses), (arm, losses)
        final = sum(losses[-TAIL:]) / TAIL
        assert abs(final / exact - 1) <= 0.01, (arm, final, exact)
