"""A measured choice between flat and hierarchical where the cost model cannot tell them apart.

The cost model picks each call's algorithm from the probed link model. Near the size where flat and
hierarchical cross over, its two predictions are close and its error (tens of percent at mid sizes on a
shared machine) decides the pick. For ops whose result does not depend on the algorithm and does not change
when the call is repeated (all_gather and broadcast move bytes, they add nothing), memrt then times both on
the first call of that op and size class, before running it: rounds of back-to-back calls with the call's own
arguments, each round one block per algorithm (alternating which goes first, a barrier before each block),
every block timed on every rank. The ranks exchange their times through the job's store; a round's time per
algorithm is its slowest rank's. The model's pick stands unless the other algorithm was faster in so many
rounds that chance would give that less than 5% of the time (a sign test) and by at least 5% (MARGIN, the
median of the rounds' ratios): a noisy or narrow measurement keeps the model's pick, a clear one overrides it.
Each algorithm runs where the call would run it (flat on the calling thread, memrt's hierarchical algorithm
on its comm thread, the caller waiting), so the hand-off between threads is part of hier's time. That pick
holds for the rest of the job. Reducing ops (all_reduce, reduce_scatter) sum in an order that differs between
the algorithms, so their pick stays the model's: a timing may change a job's speed, never its numbers.

Every rank makes the same calls in the same order, so every rank reaches the first call of a size class
together and runs the same trials; the exchange is one store write and one read of every rank's figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

__all__ = ["MARGIN", "MeasuredPicks", "MOVE_OPS", "TIE_RATIO", "decide_from_rounds", "trial_plan", "wins_needed"]

MOVE_OPS = ("all_gather", "broadcast")
"""Ops whose result is the same bits under either algorithm, and the same when the call is repeated."""

TIE_RATIO = 1.35
"""Predictions within this factor of each other are a tie the model cannot settle: timed. (Measured on the
emulated 2 x 2 cluster at 1 Gbit/s, 4 ranks on 2 cores: the model's hierarchical all-gather assumes its two
stages overlap, which CPU contention does not allow; at 16 MiB it predicted hier 86 ms and flat 108 ms, 25%
apart, and hier took 134 ms against flat's 120 ms; where the predictions were 44-49% apart, at 64 and 256 MiB,
its pick was right.)"""

SIGNIFICANCE = 0.05
"""The chance, were both algorithms equally fast, that the trials override the model's pick."""

MARGIN = 1.05
"""The other algorithm must also be this many times faster (median over the rounds of its time against the
model's pick's, paired): within a few percent the two trade places from one second to the next on a shared
machine (all-gather at 1 MiB, 2026-12-05: hier 3% faster in one second's trials, 9% slower over the sweep's
minutes), and a pick within that much of the better one costs at most that much."""

ALGORITHMS = ("flat", "hier")

EXCHANGE_TIMEOUT_S = 300.0
"""How long a rank waits for the others' trial figures (they are one call away on a healthy job)."""


def size_class(nbytes: int) -> int:
    """Calls are grouped by size rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, nbytes))))


def trial_plan(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per block) of the trials for calls of ``nbytes`` (the caller's bytes; the same figures on
    every rank). Small calls spread by tens of percent from one to the next on a shared machine and cost little:
    many rounds of many calls. Large ones spread less and cost seconds at 1 Gbit/s: fewer, of one call each.
    (All-gather at 256 KiB per rank, 2026-12-05: blocks of 4 calls put hier 0.96-1.05x flat's speed, blocks of
    2 calls 0.97-1.04x, the sweep's rounds of 2 calls 0.98x.)"""
    size = size_class(nbytes)
    if size <= 64 * 2**10:
        return 16, 16
    if size <= 2**20:  # few calls back to back: longer runs of them favour hier, which overlaps one call's
        return 24, 2   # inter-node stage with the previous one's intra-node stage, more than a job does
    if size <= 16 * 2**20:
        return 12, 1
    return 6, 1


def wins_needed(rounds: int) -> int:
    """The fewest rounds of ``rounds`` the other algorithm must win to override the model's pick: the smallest
    k with P(at least k wins | each round a coin toss) <= SIGNIFICANCE (one-sided sign test)."""
    for k in range(rounds + 1):
        if sum(math.comb(rounds, i) for i in range(k, rounds + 1)) / 2**rounds <= SIGNIFICANCE:
            return k
    return rounds + 1  # too few rounds to ever override


def decide_from_rounds(model_pick: str, figures: list[dict[str, list[float]]]) -> tuple[str, str]:
    """(algorithm, reason) from every rank's block times (``figures[rank][algorithm][round]``, seconds per call):
    a round's time per algorithm is its slowest rank's; the other algorithm replaces the model's pick only when
    it was faster in at least :func:`wins_needed` of the rounds and by MARGIN (median of the rounds' ratios)."""
    other = next(a for a in ALGORITHMS if a != model_pick)
    rounds = min(len(f[a]) for f in figures for a in ALGORITHMS)
    slowest = {a: [max(f[a][r] for f in figures) for r in range(rounds)] for a in ALGORITHMS}
    wins = sum(slowest[other][r] < slowest[model_pick][r] for r in range(rounds))
    need = wins_needed(rounds)
    ratio = statistics.median(slowest[model_pick][r] / slowest[other][r] for r in range(rounds))
    chosen = other if wins >= need and ratio >= MARGIN else model_pick
    medians = ", ".join(f"{a} {statistics.median(slowest[a]) * 1e3:.3g} ms" for a in ALGORITHMS)
    return chosen, (f"measured: {other} faster in {wins} of {rounds} rounds, {ratio:.3f}x ({need} rounds and "
                    f"{MARGIN}x override the model's {model_pick}); per call, slowest rank, median: {medians}")


@dataclasses.dataclass
class _Entry:
    candidates: dict[str, float]
    model_pick: str
    chosen: str | None = None
    reason: str = ""


class MeasuredPicks:
    """Per (op, size class, source rank): the model's pick, or the measured pick once its trials have run."""

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation
        self._entries: dict[tuple, _Entry] = {}
        self._exchanges = 0

    @staticmethod
    def key(op: str, nbytes: int, src: int = 0) -> tuple:
        """(op, size class, source rank for broadcast else 0): calls that share one pick."""
        return op, size_class(nbytes), src if op == "broadcast" else 0

    def choose(self, op: str, nbytes: int, candidates: dict[str, float], model_pick: str, *,
               src: int = 0) -> tuple[str, tuple | None]:
        """(algorithm to run, trial key or None). With a trial key the caller runs :meth:`measure` first, with
        runners of this very call; the algorithm returned is then the model's until it has."""
        if op not in MOVE_OPS or set(candidates) != set(ALGORITHMS) or model_pick not in ALGORITHMS:
            return model_pick, None
        key = self.key(op, nbytes, src)
        entry = self._entries.get(key)
        if entry is None:
            lo, hi = sorted(candidates.values())
            entry = self._entries[key] = _Entry(dict(candidates), model_pick)
            if lo <= 0 or hi / lo > TIE_RATIO:
                entry.chosen = model_pick
        if entry.chosen is not None:
            return entry.chosen, None
        return model_pick, key

    def measure(self, key: tuple, runners: dict[str, Callable[[], Any]], *, barrier: Callable[[], Any],
                sync: Callable[[], Any], store: Any, rank: int, world: int) -> str:
        """Time ``runners`` (one complete call of each algorithm, the caller's own arguments), agree with the
        other ranks through ``store`` and settle ``key``'s pick. Collective: every rank calls it at the same call.
        ``sync`` waits for the device (a no-op on CPU)."""
        entry = self._entries[key]
        rounds, calls = trial_plan(key[1])
        mine: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
        for algorithm in ALGORITHMS:  # first use of each path (buffers, sub-groups) is not timed
            runners[algorithm]()
            sync()
        for r in range(rounds):
            for algorithm in ALGORITHMS if r % 2 == 0 else ALGORITHMS[::-1]:
                barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    runners[algorithm]()
                sync()
                mine[algorithm].append((time.perf_counter() - start) / calls)
        figures = self._exchange(key, mine, store, rank, world)
        entry.chosen, entry.reason = decide_from_rounds(entry.model_pick, figures)
        return entry.chosen

    def _exchange(self, key: tuple, mine: dict[str, list[float]], store: Any, rank: int,
                  world: int) -> list[dict[str, list[float]]]:
        """Every rank's trial figures (collective over the store)."""
        prefix = f"memrt/measured_pick/{self.generation}/{self._exchanges}"
        self._exchanges += 1
        if world == 1:
            return [mine]
        store.set(f"{prefix}/{rank}", json.dumps(mine))
        keys = [f"{prefix}/{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=EXCHANGE_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - a rank that never reports: the job cannot agree
            raise RuntimeError(f"memrt.comm: ranks did not agree on the {key[0]} algorithm for "
                               f"{key[1]} B calls within {EXCHANGE_TIMEOUT_S:.0f} s: {exc}") from exc
        return [json.loads(store.get(k)) for k in keys]

    def predicted(self, key: tuple) -> float | None:
        """The model's prediction for ``key``'s settled algorithm."""
        entry = self._entries[key]
        return entry.candidates.get(entry.chosen)

    def settled(self, op: str, nbytes: int, src: int = 0) -> bool:
        """True once calls of this op and size class run one algorithm (the model's or the measured one)."""
        entry = self._entries.get(self.key(op, nbytes, src))
        return entry is not None and entry.chosen is not None

    def reason(self, op: str, nbytes: int, src: int = 0) -> str:
        """Why the measured pick for this call's size class is what it is ("" before it is settled)."""
        entry = self._entries.get(self.key(op, nbytes, src))
        return entry.reason if entry is not None else ""

    def decided(self) -> dict[tuple, tuple[str, str]]:
        """(op, size class, src) -> (algorithm, reason) of every measured pick so far."""
        return {k: (e.chosen, e.reason) for k, e in self._entries.items() if e.chosen is not None and e.reason}
