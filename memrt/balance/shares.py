"""Shares of a global batch and the deterministic rule that sets them.

Every rank exchanges its figures (samples/s, most samples its memory holds; :mod:`memrt.balance.exchange`),
then runs :func:`decide_shares` on the identical exchanged values, so every rank computes the same shares
without any further message.

The rule: rank r's ideal share is ``B * s_r / sum(s)`` (s = measured samples/s), clamped to
``[min_share, max_samples_r]`` with the excess of clamped ranks spread over the others in proportion to
their speed (water filling); the real-valued shares are rounded by largest remainder (ties: lower rank
first), never below ``min_share`` nor above a rank's memory bound. ``min_share`` is 1: every rank gets at
least one sample, so every rank runs every step and DDP's collectives always match up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Shares", "decide_shares", "predicted_step_seconds", "uniform_shares"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Shares:
    """Samples of every global batch per rank; ``sum(per_rank) == global_batch``."""

    per_rank: tuple[int, ...]
    """Samples rank r takes from every global batch (>= 1 each)."""
    global_batch: int
    """B: samples per optimizer step over all ranks."""

    def __post_init__(self) -> None:
        if sum(self.per_rank) != self.global_batch:
            raise ValueError(f"per_rank={self.per_rank} sums to {sum(self.per_rank)}, not global_batch="
                             f"{self.global_batch}")
        if any(b < 1 for b in self.per_rank):
            raise ValueError(f"per_rank={self.per_rank}: every rank needs at least one sample")

    def offset(self, rank: int) -> int:
        """Index of rank's first sample within a global batch (ranks take consecutive slices)."""
        return sum(self.per_rank[:rank])

    def weight(self, rank: int) -> float:
        """b_r / B: the factor on rank r's mean-loss gradient before the SUM all-reduce."""
        return self.per_rank[rank] / self.global_batch

    def to_dict(self) -> dict:
        return {"per_rank": list(self.per_rank), "global_batch": self.global_batch}


def uniform_shares(global_batch: int, world_size: int) -> Shares:
    """B split as evenly as possible; the first ``B % W`` ranks take one sample more."""
    if global_batch < world_size:
        raise ValueError(f"global_batch={global_batch} is smaller than the world size {world_size}: every "
                         "rank needs at least one sample; raise global_batch")
    q, r = divmod(global_batch, world_size)
    return Shares(per_rank=tuple(q + (1 if i < r else 0) for i in range(world_size)), global_batch=global_batch)


def _water_fill(total: float, speeds: Sequence[float], lo: float, hi: Sequence[float]) -> list[float]:
    n = len(speeds)
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        if not free:
            return [fixed[i] for i in range(n)]
        remaining = total - sum(fixed.values())
        speed_sum = sum(speeds[i] for i in free)
        x = {i: remaining * speeds[i] / speed_sum for i in free}
        over = [i for i in free if x[i] > hi[i]]
        if over:
            fixed.update({i: float(hi[i]) for i in over})
            continue
        under = [i for i in free if x[i] < lo]
        if under:
            fixed.update({i: float(lo) for i in under})
            continue
        fixed.update(x)


def decide_shares(global_batch: int, speeds: Sequence[float], max_samples: Sequence[int | None] | None = None,
                  *, min_share: int = 1) -> Shares:
    """Shares proportional to ``speeds`` (samples/s), bounded by ``max_samples`` per rank.

    Deterministic: the same inputs give the same shares on every rank. Raises ``ValueError`` naming
    the bad input (non-positive speed, memory bounds that cannot hold the global batch, B < W).
    """
    w = len(speeds)
    if w == 0:
        raise ValueError("speeds is empty: need one samples/s figure per rank")
    if min_share < 1:
        raise ValueError(f"min_share={min_share} is not valid: every rank needs >= 1 sample per step")
    for r, s in enumerate(speeds):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"speeds[{r}]={s!r} is not valid: expected measured samples/s > 0")
    caps = [global_batch if m is None else int(m) for m in (max_samples or [None] * w)]
    if len(caps) != w:
        raise ValueError(f"max_samples has {len(caps)} entries for {w} ranks")
    if global_batch < w * min_share:
        raise ValueError(f"global_batch={global_batch} < world size {w} x min_share {min_share}: raise "
                         "global_batch (every rank takes at least one sample per step)")
    for r, c in enumerate(caps):
        if c < min_share:
            raise ValueError(f"max_samples[{r}]={c}: rank {r}'s memory holds fewer than {min_share} sample(s); "
                             "raise its memory budget (MEMRT_BUDGET) or shrink the model")
    if sum(caps) < global_batch:
        raise ValueError(f"global_batch={global_batch} does not fit: the ranks' memory bounds max_samples={caps} "
                         f"hold {sum(caps)} samples per step; lower global_batch or raise the budgets")
    ideal = _water_fill(float(global_batch), speeds, float(min_share), [float(c) for c in caps])
    base = [min(caps[r], max(min_share, math.floor(x + 1e-9))) for r, x in enumerate(ideal)]
    left = global_batch - sum(base)
    order = sorted(range(w), key=lambda r: (-(ideal[r] - base[r]), r))
    while left > 0:
        progressed = False
        for r in order:
            if left == 0:
                break
            if base[r] < caps[r]:
                base[r] += 1
                left -= 1
                progressed = True
        if not progressed:  # unreachable: sum(caps) >= global_batch was checked
            raise RuntimeError("share rounding could not place every sample")
    while left < 0:  # floors forced up to min_share overshoot: take back from the largest shares
        r = max((i for i in range(w) if base[i] > min_share), key=lambda i: (base[i] - ideal[i], base[i], -i))
        base[r] -= 1
        left += 1
    return Shares(per_rank=tuple(base), global_batch=global_batch)


def predicted_step_seconds(shares: Shares, speeds: Sequence[float]) -> float:
    """Synchronous step time predicted from per-rank speeds: the slowest rank's ``b_r / s_r``."""
    return max(b / s for b, s in zip(shares.per_rank, speeds))
