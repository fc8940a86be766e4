"""broadcast / all_gather / reduce_scatter, the DDP hook (bitwise vs plain DDP) and the mismatch check.

One 4-process gloo job (MEMRT_TOPOLOGY="0,1;2,3", MEMRT_COMM=hier) runs all three so the suite
pays for one start-up. The DDP model and data sit on a coarse grid so every gradient sum is exact in
float32: plain DDP (gloo's ring order) and the hook (hierarchical order) must then agree bit for bit,
and any wrong value (a missing rank, a double count, a wrong scale) shows as a difference.
"""

from __future__ import annotations

import pytest

from memrt.testing import run_processes

from _comm_workers import everything_else


@pytest.mark.slow
def test_collectives_ddp_hook_and_mismatch_check():
    out = run_processes(everything_else, 4, env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier"}, timeout=300)
    for rank, res in enumerate(out):
        assert res["collectives"] == [], (rank, res["collectives"])
        assert res["ddp"] == [], (rank, res["ddp"])
        assert "rank(s) [3]: all_reduce(float32, shape=(5,)" in res["mismatch"], (rank, res["mismatch"])
        assert "rank(s) [0, 1, 2]: all_reduce(float32, shape=(4,)" in res["mismatch"], (rank, res["mismatch"])
