"""A measured choice between flat and hierarchical where the cost model cannot tell them apart.

The cost model picks each call's algorithm from the probed link model. Near the size where flat and
hierarchical cross over, its two predictions are close and its error (tens of percent at mid sizes on a
shared machine) decides the pick. For ops whose result does not depend on the algorithm (all_gather and
broadcast move bytes, they add nothing), memrt then times both: the first calls of that op and size class
run one algorithm, then the other (a block each), each call to completion and timed on every rank, and the ranks
agree through the job's store on the one whose slowest rank was faster. That pick holds for the rest of
the job. Reducing ops (all_reduce, reduce_scatter) sum in an order that differs between the algorithms, so
their pick stays the model's: a timing may change a job's speed, never its numbers.

Every rank makes the same calls in the same order, so every rank runs the same trials and reaches the
exchange at the same call; the exchange is one store write and one read of every rank's figures per op
and size class.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from datetime import timedelta
from typing import Any

__all__ = ["MeasuredPicks", "MOVE_OPS", "TIE_RATIO", "TRIALS"]

MOVE_OPS = ("all_gather", "broadcast")
"""Ops whose result is the same bits under either algorithm."""

TIE_RATIO = 1.35
"""Predictions within this factor of each other are a tie the model cannot settle: timed. (Measured on the
emulated 2 x 2 cluster at 1 Gbit/s, 4 ranks on 2 cores: the model's hierarchical all-gather assumes its two
stages overlap, which CPU contention does not allow; at 16 MiB it predicted hier 86 ms and flat 108 ms, 25%
apart, and hier took 134 ms against flat's 120 ms; where the predictions were 44-49% apart, at 64 and 256 MiB,
its pick was right, and at 1-2% apart its error decided.)"""

TRIALS = 5
"""Timed calls per algorithm (the median counts): single calls of a few milliseconds spread by tens of
percent on a shared machine."""

ALGORITHMS = ("flat", "hier")

EXCHANGE_TIMEOUT_S = 300.0
"""How long a rank waits for the others' trial figures (they are one call away on a healthy job)."""


def size_class(nbytes: int) -> int:
    """Calls are grouped by size rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, nbytes))))


def _key(op: str, nbytes: int, src: int) -> tuple:
    """(op, size class, source rank for broadcast else 0): calls that share one pick."""
    return op, size_class(nbytes), src if op == "broadcast" else 0


@dataclasses.dataclass
class _Entry:
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {a: [] for a in ALGORITHMS})
    calls: int = 0
    chosen: str | None = None
    reason: str = ""


class MeasuredPicks:
    """Per (op, size class, source rank): the model's pick, or trials then the measured pick."""

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation
        self._entries: dict[tuple, _Entry] = {}
        self._exchanges = 0

    def choose(self, op: str, nbytes: int, candidates: dict[str, float], model_pick: str, *,
               src: int = 0) -> tuple[str, tuple | None]:
        """(algorithm to run, trial key or None). With a trial key the caller runs the call to completion,
        then reports its seconds with :meth:`add`."""
        if op not in MOVE_OPS or set(candidates) != set(ALGORITHMS) or model_pick not in ALGORITHMS:
            return model_pick, None
        key = _key(op, nbytes, src)
        entry = self._entries.get(key)
        if entry is None:
            lo, hi = sorted(candidates.values())
            entry = self._entries[key] = _Entry()
            if lo <= 0 or hi / lo > TIE_RATIO:
                entry.chosen = model_pick
        if entry.chosen is not None:
            return entry.chosen, None
        # a block of calls per algorithm; the first call of a block waits out the previous algorithm's skew
        # between ranks (their last stages end at different times) and is not counted
        algorithm = ALGORITHMS[entry.calls // (TRIALS + 1)]
        entry.calls += 1
        return algorithm, key

    def add(self, key: tuple, algorithm: str, seconds: float) -> None:
        entry = self._entries[key]
        if entry.calls % (TRIALS + 1) != 1:  # not the first call of its block
            entry.seconds[algorithm].append(seconds)

    def pending(self, key: tuple) -> bool:
        """True when ``key``'s trials are all in on this rank (every rank: the same call) and the ranks must now
        agree (:meth:`settle`)."""
        entry = self._entries[key]
        return entry.chosen is None and all(len(s) >= TRIALS for s in entry.seconds.values())

    def settle(self, key: tuple, store: Any, rank: int, world: int) -> str:
        """Agree on ``key``'s algorithm: each rank's median per algorithm through ``store``, the algorithm
        whose slowest rank is fastest wins (ties: flat). Collective over the store: every rank calls it."""
        entry = self._entries[key]
        mine = {a: statistics.median(s) for a, s in entry.seconds.items()}
        prefix = f"memrt/measured_pick/{self.generation}/{self._exchanges}"
        self._exchanges += 1
        if world > 1:
            store.set(f"{prefix}/{rank}", json.dumps(mine))
            keys = [f"{prefix}/{r}" for r in range(world)]
            try:
                store.wait(keys, timedelta(seconds=EXCHANGE_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - a rank that never reports: the job cannot agree
                raise RuntimeError(f"memrt.comm: ranks did not agree on the {key[0]} algorithm for "
                                   f"{key[1]} B calls within {EXCHANGE_TIMEOUT_S:.0f} s: {exc}") from exc
            figures = [json.loads(store.get(k)) for k in keys]
        else:
            figures = [mine]
        slowest = {a: max(f[a] for f in figures) for a in ALGORITHMS}
        entry.chosen = min(ALGORITHMS, key=lambda a: (slowest[a], ALGORITHMS.index(a)))
        entry.reason = ("measured: " + ", ".join(f"{a} {slowest[a] * 1e3:.3g} ms" for a in ALGORITHMS)
                        + f" (slowest rank, median of {TRIALS}; the model could not tell them apart)")
        return entry.chosen

    def settled(self, op: str, nbytes: int, src: int = 0) -> bool:
        """True once calls of this op and size class run one algorithm (the model's or the measured one)."""
        entry = self._entries.get(_key(op, nbytes, src))
        return entry is not None and entry.chosen is not None

    def reason(self, op: str, nbytes: int, src: int = 0) -> str:
        """Why the measured pick for this call's size class is what it is ("" before it is settled)."""
        entry = self._entries.get(_key(op, nbytes, src))
        return entry.reason if entry is not None else ""

    def decided(self) -> dict[tuple, tuple[str, str]]:
        """(op, size class, src) -> (algorithm, reason) of every measured pick so far."""
        return {k: (e.chosen, e.reason) for k, e in self._entries.items() if e.chosen is not None and e.reason}
