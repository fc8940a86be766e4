"""The measured pick between flat and hierarchical all_gather / broadcast where the cost model ties."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as tdist

from memrt.comm.measured_pick import (MARGIN, TIE_RATIO, MeasuredPicks, decide_from_rounds, size_class, trial_plan,
                                      wins_needed)
from memrt.testing import run_processes

from _comm_workers import measured_picks


def test_a_clear_prediction_is_kept_and_reducing_ops_are_never_timed():
    picks = MeasuredPicks()
    assert picks.choose("all_gather", 1 << 20, {"flat": 1.0, "hier": 2.0 * TIE_RATIO}, "flat") == ("flat", None)
    for op in ("all_reduce", "reduce_scatter"):
        assert picks.choose(op, 1 << 20, {"flat": 1.0, "hier": 1.0}, "hier") == ("hier", None)
    # a tie: the model's pick with a trial key, until the trials have run
    algorithm, key = picks.choose("all_gather", 1000, {"flat": 1.0, "hier": 1.1}, "hier")
    assert algorithm == "hier" and key == ("all_gather", 1024, 0) and not picks.settled("all_gather", 1000)


def test_only_a_clear_majority_of_rounds_overrides_the_model_and_the_slowest_rank_counts():
    # one-sided sign test at 5%: P(>= k of n | coin) <= 0.05
    assert [wins_needed(n) for n in (4, 6, 8, 12, 16, 24)] == [5, 6, 7, 10, 12, 17]
    rounds = 16
    for wins, want in ((11, "flat"), (12, "hier")):
        # rank 0: hier faster in every round; rank 1 (the slowest) decides: hier faster in ``wins`` rounds
        rank0 = {"flat": [0.5] * rounds, "hier": [0.4] * rounds}
        rank1 = {"flat": [1.0] * rounds, "hier": [0.9] * wins + [1.5] * (rounds - wins)}
        chosen, reason = decide_from_rounds("flat", [rank0, rank1])
        assert chosen == want, (wins, reason)
        assert reason.startswith(f"measured: hier faster in {wins} of 16 rounds, 1.111x"), reason
    # faster in every round but by less than MARGIN: the model's pick stays
    narrow = {"flat": [1.0] * rounds, "hier": [1.0 / (MARGIN - 0.01)] * rounds}
    assert decide_from_rounds("flat", [narrow])[0] == "flat"
    wide = {"flat": [1.0] * rounds, "hier": [1.0 / (MARGIN + 0.01)] * rounds}
    assert decide_from_rounds("flat", [wide])[0] == "hier"
    # slower in the slowest rank's figures even though faster on rank 0: the model's pick stays
    rank0 = {"flat": [1.0] * 8, "hier": [0.1] * 8}
    rank1 = {"flat": [1.0] * 8, "hier": [3.0] * 8}
    assert decide_from_rounds("flat", [rank0, rank1])[0] == "flat"
    assert decide_from_rounds("hier", [rank0, rank1])[0] == "flat"


def test_small_calls_get_more_timed_calls():
    plans = [trial_plan(n) for n in (8, 64 << 10, 1 << 20, 16 << 20, 256 << 20)]
    assert plans == sorted(plans, key=lambda p: -p[0] * p[1]) and plans[0] == (16, 16) and plans[-1] == (6, 1)
    assert all(wins_needed(r) <= r for r, _ in plans)  # every plan can override


def test_measure_runs_alternating_blocks_then_both_ranks_agree(monkeypatch):
    from memrt.comm import measured_pick

    monkeypatch.setattr(measured_pick, "EXCHANGE_TIMEOUT_S", 20.0)  # a failing rank: the other gives up soon
    store = tdist.HashStore()
    nbytes = 256 << 20  # the plan's fewest rounds: 6 of one call
    rounds, calls = trial_plan(nbytes)
    ranks = [MeasuredPicks(generation=7) for _ in range(2)]
    # rank 1 is slow under flat: hier is faster for the slowest rank in every round
    delay = [{"flat": 0.002, "hier": 0.004}, {"flat": 0.012, "hier": 0.004}]
    calls_seen: list[list[str]] = [[], []]
    barriers = [0, 0]
    got: dict[int, str] = {}

    def rank_main(rank: int) -> None:
        picks = ranks[rank]
        algorithm, key = picks.choose("broadcast", nbytes, {"flat": 1.0, "hier": 1.05}, "flat", src=2)
        assert algorithm == "flat" and key is not None

        def runner(a: str):
            return lambda: (calls_seen[rank].append(a), time.sleep(delay[rank][a]))

        def barrier() -> None:
            barriers[rank] += 1

        got[rank] = picks.measure(key, {a: runner(a) for a in ("flat", "hier")}, barrier=barrier,
                                  sync=lambda: None, store=store, rank=rank, world=2)

    t = threading.Thread(target=rank_main, args=(1,), daemon=True)
    t.start()
    rank_main(0)
    t.join(30)
    assert got == {0: "hier", 1: "hier"}
    want = ["flat", "hier"]  # one untimed call of each path, then a block per algorithm, the order alternating
    for r in range(rounds):
        want += (["flat"] * calls + ["hier"] * calls) if r % 2 == 0 else (["hier"] * calls + ["flat"] * calls)
    assert calls_seen == [want, want] and barriers == [2 * rounds] * 2
    for picks in ranks:  # the size class keeps it; another source rank is another class
        assert picks.choose("broadcast", (128 << 20) + 1, {"flat": 1.0, "hier": 1.05}, "flat", src=2) == ("hier", None)
        assert picks.choose("broadcast", nbytes, {"flat": 1.0, "hier": 1.05}, "flat", src=0)[1] is not None
        assert picks.reason("broadcast", nbytes, 2).startswith("measured: hier faster in 6 of 6 rounds, ")
    assert size_class(5000) == size_class(8192) == 8192


@pytest.mark.slow
def test_measured_picks_agree_and_never_change_results():
    out = run_processes(measured_picks, 4, env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "auto"}, timeout=300)
    for rank, res in enumerate(out):
        assert res["fails"] == [], (rank, res["fails"])
        for name, seq in res["sequences"].items():  # one record per user call, never the trials'
            assert len(seq) == res["calls"] and len(set(seq)) == 1, (rank, name, seq)
        assert res["picks"] == out[0]["picks"], (rank, res["picks"], out[0]["picks"])
        assert res["reasons"] and all(r.startswith("measured: ") for r in res["reasons"]), res["reasons"]
    assert len(out[0]["picks"]) == 6, out[0]["picks"]
