"""The measured pick between flat and hierarchical all_gather / broadcast where the cost model ties."""

from __future__ import annotations

import pytest
import torch.distributed as tdist

from memrt.comm.measured_pick import TIE_RATIO, TRIALS, MeasuredPicks, size_class
from memrt.testing import run_processes

from _comm_workers import measured_picks


def test_a_clear_prediction_is_kept_and_reducing_ops_are_never_timed():
    picks = MeasuredPicks()
    assert picks.choose("all_gather", 1 << 20, {"flat": 1.0, "hier": 2.0 * TIE_RATIO}, "flat") == ("flat", None)
    for op in ("all_reduce", "reduce_scatter"):
        assert picks.choose(op, 1 << 20, {"flat": 1.0, "hier": 1.0}, "hier") == ("hier", None)


def test_trials_alternate_then_the_slowest_rank_decides():
    store = tdist.HashStore()
    ranks = [MeasuredPicks(generation=7) for _ in range(2)]
    # rank 0 finds flat faster, rank 1 finds flat much slower: the slowest rank's figure counts
    seconds = [{"flat": 1.0, "hier": 2.0}, {"flat": 5.0, "hier": 2.5}]
    keys = []
    for i in range(2 * (TRIALS + 1)):  # a block per algorithm; the first call of a block is not counted
        for rank, picks in enumerate(ranks):
            algorithm, key = picks.choose("broadcast", 5000, {"flat": 1.0, "hier": 1.05}, "flat", src=2)
            assert algorithm == ("flat", "hier")[i // (TRIALS + 1)] and key is not None
            first = i % (TRIALS + 1) == 0
            picks.add(key, algorithm, 100.0 if first else seconds[rank][algorithm])
            keys.append(key)
            assert picks.pending(key) == (i == 2 * TRIALS + 1)
    assert all(p.pending(keys[-1]) for p in ranks)
    # both ranks write their figures before either reads: run rank 1's settle from a thread
    import threading

    got = {}
    t = threading.Thread(target=lambda: got.setdefault(1, ranks[1].settle(keys[-1], store, 1, 2)))
    t.start()
    got[0] = ranks[0].settle(keys[-1], store, 0, 2)
    t.join(10)
    assert got == {0: "hier", 1: "hier"}
    for picks in ranks:  # the size class keeps it; another source rank is another class
        assert picks.choose("broadcast", 4097, {"flat": 1.0, "hier": 1.05}, "flat", src=2) == ("hier", None)
        assert picks.choose("broadcast", 5000, {"flat": 1.0, "hier": 1.05}, "flat", src=0)[1] is not None
        assert "measured" in picks.reason("broadcast", 5000, 2)
    assert size_class(5000) == size_class(8192) == 8192


@pytest.mark.slow
def test_measured_picks_agree_and_never_change_results():
    out = run_processes(measured_picks, 4, env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "auto"}, timeout=300)
    for rank, res in enumerate(out):
        assert res["fails"] == [], (rank, res["fails"])
        for name, seq in res["sequences"].items():
            trials = 2 * (TRIALS + 1)
            assert seq[:trials] == ["flat"] * (TRIALS + 1) + ["hier"] * (TRIALS + 1), (rank, name, seq)
            assert len(set(seq[trials:])) == 1 and len(seq) == trials + 3, (rank, name, seq)
        assert res["picks"] == out[0]["picks"], (rank, res["picks"], out[0]["picks"])
        assert res["reasons"] and all("measured" in r for r in res["reasons"]), res["reasons"]
    assert len(out[0]["picks"]) == 4, out[0]["picks"]
