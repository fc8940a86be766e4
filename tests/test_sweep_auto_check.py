"""The collectives sweep's auto check on synthetic rounds: the direct interval and the decomposed bound."""

from __future__ import annotations

import random

from benchmarks.collectives_sweep import AUTO_SLACK, auto_check


def _res(flat: list[float], hier: list[float], auto: list[float], chose: str, decision_s: float | None) -> dict:
    def row(mode: str, times: list[float]) -> dict:
        return {"op": "all_gather", "size": 4096, "mode": mode, "time_s": sorted(times)[len(times) // 2],
                "times_s": times, "algorithm": chose if mode == "auto" else mode,
                "predicted_s": {"flat": 1e-3, "hier": 2e-3} if mode == "auto" else None,
                "decision_s": decision_s if mode == "auto" else None}

    return {"results": {"memrt-check": {"rows": [row("flat", flat), row("hier", hier), row("auto", auto)]}}}


def _noisy(base: float, n: int, spread: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [base * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_right_pick_is_shown_within_where_the_direct_interval_cannot_tell():
    flat, hier = _noisy(3e-3, 42, 0.15, 1), _noisy(4e-3, 42, 0.15, 2)
    auto = _noisy(3e-3, 42, 0.15, 3)  # the same algorithm as flat: auto vs flat differ by noise only
    (c,) = auto_check(_res(flat, hier, auto, "flat", 2e-6), "all_gather")
    assert not c["shown_within"], c  # +-15% per round: the direct interval is too wide for 5%
    assert c["bound_within"] and c["bound_ci95_high"] <= AUTO_SLACK and not c["pick_wrong"], c
    assert c["pick_ci95"][1] < 1.0, c


def test_wrong_pick_is_shown_wrong_and_not_within():
    flat, hier = _noisy(3e-3, 42, 0.05, 1), _noisy(4e-3, 42, 0.05, 2)
    (c,) = auto_check(_res(flat, hier, _noisy(4e-3, 42, 0.05, 3), "hier", 2e-6), "all_gather")
    assert c["pick_wrong"] and not c["bound_within"] and c["wrong"], c


def test_close_algorithms_and_a_costly_decision_are_not_shown():
    flat, hier = _noisy(3e-3, 42, 0.15, 1), _noisy(3.05e-3, 42, 0.15, 2)  # within noise of each other
    (c,) = auto_check(_res(flat, hier, _noisy(3e-3, 42, 0.15, 3), "hier", 2e-6), "all_gather")
    assert not c["bound_within"], c  # the interval of hier / flat reaches past 1.05
    flat, hier = [3e-3] * 42, [6e-3] * 42
    (c,) = auto_check(_res(flat, hier, [3.3e-3] * 42, "flat", 3e-4), "all_gather")  # a 10% decision cost
    assert c["bound_ci95_high"] > AUTO_SLACK and not c["bound_within"], c


def test_no_bound_where_auto_ran_both_algorithms():
    flat, hier = [3e-3] * 10, [6e-3] * 10
    (c,) = auto_check(_res(flat, hier, [3e-3] * 10, "flat/hier", None), "all_gather")
    assert c["bound_ci95_high"] is None and not c["bound_within"], c


def test_premise_checked_auto_slower_than_its_chosen_algorithm_is_not_shown():
    flat, hier = _noisy(3e-3, 42, 0.02, 1), _noisy(6e-3, 42, 0.02, 2)
    (c,) = auto_check(_res(flat, hier, _noisy(3.6e-3, 42, 0.02, 3), "flat", 2e-6), "all_gather")
    assert c["premise_holds"] is False and not c["bound_within"], c


def test_an_open_point_gets_a_second_look_and_more_rounds_settle_it():
    from benchmarks.collectives_sweep import CHECK_LOOKS, CHECK_Z, check_point, is_open

    assert CHECK_LOOKS == 2 and 2.2 < CHECK_Z < 2.3  # each look at 97.5%: 95% per point over both
    rng = random.Random(5)
    flat = [3e-3 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(12)]
    hier = [f * 1.02 * (1 + rng.uniform(-0.1, 0.1)) for f in flat]  # hier 2% slower, rounds +-10% apart
    auto = [f * (1 + rng.uniform(-0.1, 0.1)) for f in flat]

    def modes(n: int, looks: int) -> dict:
        row = lambda m, t: {"mode": m, "time_s": sorted(t[:n])[n // 2], "times_s": t[:n], "rounds": n, "looks": looks,
                            "algorithm": "flat" if m == "auto" else m, "decision_s": 2e-6 if m == "auto" else None}
        return {"flat": row("flat", flat), "hier": row("hier", hier), "auto": row("auto", auto)}

    first = check_point("all_gather", 4096, modes(12, 1), "interleaved")
    assert is_open(first) and first["looks"] == 1, first  # 12 rounds cannot tell flat from hier within 5%
    flat += [3e-3 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(24)]
    hier += [f * 1.02 * (1 + rng.uniform(-0.02, 0.02)) for f in flat[12:]]
    auto += [f * (1 + rng.uniform(-0.02, 0.02)) for f in flat[12:]]
    second = check_point("all_gather", 4096, modes(36, 2), "interleaved")
    assert not is_open(second) and second["bound_within"] and second["rounds"] == 36 and second["looks"] == 2, second
