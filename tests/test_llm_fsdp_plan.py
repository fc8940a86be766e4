"""memrt.auto plans an FSDP2 model (fully_shard per block): units are the sharded blocks.

2 and 4 gloo ranks, 3 budgets between the plan's floor (every block recomputed) and its keep-all peak
(bytes of live tensors, so the same on every machine with this torch): the gathered state after 3
AdamW steps is bitwise equal to FSDP2 without memrt, every rank's plan recomputes some blocks, and the
peak measured on every rank (the unsharded parameters and gradients of the blocks in flight included,
since FSDP2 allocates them inside the measured step) is <= the budget.
"""

from __future__ import annotations

import pytest

import _llm_workers as W
from memrt.testing import run_processes

pytestmark = pytest.mark.slow

BUDGETS = [1_500_000, 1_650_000, 1_800_000]
"""For tests/_llm_workers.tiny_gpt(n_layer=4): floor ~1.43 MB (2 ranks) / ~1.40 MB (4 ranks), keep-all ~1.92 MB."""


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_planned_at_three_budgets(world):
    budgets = BUDGETS
    res = run_processes(W.fsdp_planned, world, budgets, init_process_group=False, timeout=280)
    for rank, r in enumerate(res):
        stock = r["None"]["state"]
        for b in budgets:
            got = r[str(b)]
            assert got["state"] == stock, f"rank {rank}, budget {b}: gathered state differs from FSDP2"
            plan = got["plan"]
            assert "recompute" in plan["actions"].values(), plan
            assert plan["measured"] is not None and plan["measured"] <= b, (rank, b, plan)
