"""The decision: new shares from every rank's exchanged figures, the same on every rank.

:func:`propose` is the rule both ways in use: shares in proportion to the measured samples/s, water-filled
under the memory bounds (:func:`memrt.balance.shares.decide_shares`), with the predicted gain over the shares
in force. A ``SpeedBalancer`` adopts the proposal when it cuts the predicted step time by ``min_gain``;
``MEMRT=1``'s :class:`ShareDecider` adds its hysteresis and the checks an unchanged job needs: one kind of
timing window for every rank, balanced DataLoaders on every rank, a known loss reduction. The stock split is
left only when the predicted step time drops by ``min_gain``, the fastest rank is ``min_speed_ratio`` x the
slowest and the next exchange confirms it; a balanced split moves when the predicted step time drops by
``refine_gain`` (``MEMRT_BALANCE=on``: no thresholds, and an unknown loss reduction is taken to be a mean).
Repeated, the rule settles where the ranks' step times are equal, per-step fixed costs included.

A decision is a JSON-able dict (the rank reports hold every one); its ``loaders`` entries say from which
batch position each balanced DataLoader takes which shares (applied by :mod:`memrt.balance.feed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from memrt.balance.reduction import MEAN, SUM
from memrt.balance.shares import Shares, decide_shares, predicted_step_seconds, uniform_shares

if TYPE_CHECKING:
    from memrt.config import MemrtConfig

__all__ = ["AutoBalanceConfig", "Proposal", "ShareDecider", "SharesInForce", "propose"]


@dataclass(kw_only=True, slots=True)
class AutoBalanceConfig:
    """How ``MEMRT=1``'s controller measures and decides."""

    mode: str = "auto"
    """auto | on (MEMRT_BALANCE); off never builds a controller."""
    warmup_steps: int = 2
    """Steps not timed after the start and after every share change (first calls, new plans)."""
    first_check: int = 8
    """Step count (gradient all-reduces) at the first exchange."""
    refine_after: int = 10
    """Steps after a change until the next exchange (shares follow speeds measured at the new sizes; the
    window holds the steps after ``warmup_steps`` and the batches drawn ahead of the change)."""
    recheck_every: int = 50
    """Steps between exchanges otherwise."""
    speed_steps: int = 30
    """A rank's speed is the median samples/s of its latest this many timed steps, across exchanges: one
    window of ``refine_after`` steps is noisy (a decision on it alone chases the noise), and samples/s barely
    depend on the share, so the steps before a change still tell the rank's speed."""
    min_gain: float = 0.05
    """auto: leave the stock split only when the predicted step time drops by this fraction."""
    refine_gain: float = 0.03
    """auto: move from one balanced split to another when the predicted step time drops by this fraction (the
    speeds behind the first split were measured at the stock sizes; where ranks have per-step fixed costs,
    their speeds at the new sizes differ, and the next decision refines the split)."""
    min_speed_ratio: float = 1.10
    """auto: leave the stock split only when the fastest rank is this many times the slowest."""
    exchange_timeout_s: float = 900.0
    """How long a rank waits for the others' figures (they arrive within one step of each other)."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on"):
            raise ValueError(f"mode={self.mode!r} is not valid: expected 'auto' or 'on' (MEMRT_BALANCE)")
        if self.speed_steps < 1:
            raise ValueError(f"speed_steps={self.speed_steps} is not valid: expected at least 1")
        if self.first_check <= self.warmup_steps:
            raise ValueError(f"first_check={self.first_check} must exceed warmup_steps={self.warmup_steps}")
        for name, value in (("min_gain", self.min_gain), ("refine_gain", self.refine_gain)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} is not valid: expected a fraction in [0, 1)")

    @classmethod
    def from_config(cls, config: MemrtConfig) -> AutoBalanceConfig:
        """The controller's settings of a run (``MEMRT_BALANCE``: ``config.balance``)."""
        return cls(mode=config.balance)


@dataclass(kw_only=True, slots=True, frozen=True)
class Proposal:
    """What the rule gives at the measured speeds, against the shares in force."""

    shares: Shares
    gain: float
    """1 - predicted step time with ``shares`` / with the shares in force."""
    over: bool
    """The shares in force exceed some rank's memory bound (a change is forced)."""


def propose(current: Shares, speeds: Sequence[float], bounds: Sequence[int | None]) -> Proposal:
    """The rule's shares for ``current.global_batch`` (raises ``ValueError`` when the bounds cannot hold it)."""
    proposal = decide_shares(current.global_batch, speeds, bounds)
    gain = 1.0 - predicted_step_seconds(proposal, speeds) / predicted_step_seconds(current, speeds)
    over = any(m is not None and b > m for b, m in zip(current.per_rank, bounds))
    return Proposal(shares=proposal, gain=gain, over=over)


class SharesInForce(Protocol):
    """A balanced DataLoader as the decider sees it (:class:`memrt.balance.loader.ShareSampler`)."""

    def shares_now(self) -> tuple[int, ...] | None:
        """Shares at the next draw; None = the stock split."""
        ...


class ShareDecider:
    """``MEMRT=1``'s decision from the exchanged figures (one dict per rank; :mod:`memrt.balance.auto`)."""

    def __init__(self, config: AutoBalanceConfig, world: int) -> None:
        self.config = config
        self.world = world
        self.confirmed = False
        """True when the previous decision also found that leaving the stock split would pay."""
        self.warned: set[str] = set()
        """Warnings already given (each once)."""

    def decide(self, everyone: list[dict[str, Any]], *, step: int, loaders: Sequence[SharesInForce | None],
               skipped: Mapping[str, int]) -> dict[str, Any]:
        """The same decision on every rank from the same exchanged figures."""
        between = all(p["between"] for p in everyone)  # one kind of window for every rank
        speeds = [p["sps" if between else "sps_forward"] for p in everyone]
        bounds = [p["bound"] for p in everyone]
        out: dict[str, Any] = {"step": step, "samples_per_s": speeds, "max_samples": bounds,
                               "timed": "between all-reduces" if between else "forward to last bucket",
                               "changed": False, "shares": None, "predicted_gain": 0.0, "reason": ""}
        if any(s is None or s <= 0 for s in speeds):
            out["reason"] = "speeds not measured yet"
            return out
        counts = {len(p["loaders"]) for p in everyone}
        trained = [i for i in range(min(counts)) if all(p["loaders"][i][3] for p in everyone)] if counts else []
        ratio = max(speeds) / min(speeds)
        out["speed_ratio"] = ratio
        pays = self.config.mode == "on" or ratio >= self.config.min_speed_ratio
        if len(counts) != 1 or not trained:
            out["reason"] = ("the ranks built different DataLoaders" if len(counts) > 1 else
                             "no DataLoader over a DistributedSampler (or accelerate shard) fed the training steps"
                             + (f"; left as they were: {', '.join(sorted(skipped))}" if skipped else ""))
            self._warn(out, pays, "no-loader")
            return out
        kind = self._reduction(everyone, out)
        if kind is None:
            self._warn(out, pays, "reduction")
            return out
        out["reduction"] = kind
        accum = max(p["accum"] for p in everyone)
        out["loaders"] = [change for i in trained
                          if (change := self._loader(i, everyone, speeds, bounds, loaders[i], pays, accum, out))]
        out["changed"] = bool(out["loaders"])
        self.confirmed = bool(out.get("confirm"))
        return out

    def _warn(self, out: dict[str, Any], pays: bool, key: str) -> None:
        out["warn"] = pays and key not in self.warned
        self.warned.add(key)

    def _reduction(self, everyone: list[dict[str, Any]], out: dict[str, Any]) -> str | None:
        """The loss reduction every rank saw (``on``: unknown taken as a mean), or None with the reason."""
        kinds = {p["reduction"] for p in everyone}
        if kinds == {MEAN} or kinds == {SUM}:
            return kinds.pop()
        if self.config.mode == "on" and SUM not in kinds:
            out["assumed"] = "loss reduction unknown: taken as a mean (MEMRT_BALANCE=on)"
            return MEAN
        roots = sorted({p["root"] for p in everyone if p.get("root")})
        out["reason"] = (f"the loss reduction cannot be known (seen: {', '.join(sorted(kinds))}"
                         f"{'; backward from ' + roots[0] if roots else ''}): memrt sees only the tensor "
                         "backward() starts from; MEMRT_BALANCE=on balances assuming a mean-reduced loss")
        return None

    def _loader(self, i: int, everyone: list[dict[str, Any]], speeds: list[float], bounds: list[int | None],
                sampler: SharesInForce | None, pays: bool, accum: int, out: dict[str, Any]) -> dict[str, Any] | None:
        """Loader ``i``'s change (from which position, which shares), or None; notes the outcome in ``out``."""
        rows = [p["loaders"][i] for p in everyone]
        if len({r[4] for r in rows}) != 1 or len({r[0] for r in rows}) != 1 or sampler is None:
            return None
        B = rows[0][4]
        current = sampler.shares_now()
        current_shares = (uniform_shares(B, self.world) if current is None
                          else Shares(per_rank=tuple(current), global_batch=B))
        try:
            p = propose(current_shares, speeds, bounds)
        except ValueError as exc:
            out["reason"] = str(exc)
            return None
        if self.config.mode == "on":
            min_gain = 0.0
        else:
            min_gain = self.config.min_gain if current is None else self.config.refine_gain
        leaving_stock = current is None
        adopt = p.shares != current_shares and (p.over or (p.gain > min_gain and (pays or not leaving_stock)))
        if adopt and leaving_stock and not p.over and self.config.mode == "auto" and not self.confirmed:
            adopt = False  # leave the stock split only when the next exchange confirms it (noise)
            out["confirm"] = True
        out["predicted_gain"] = p.gain
        out["shares"] = list(p.shares.per_rank if adopt else current_shares.per_rank)
        if not adopt:
            if out.get("confirm"):
                out["reason"] = "an imbalance to confirm at the next exchange"
            elif not pays:
                out["reason"] = f"speeds within {self.config.min_speed_ratio:.2f}x"
            else:
                out["reason"] = f"predicted gain {p.gain:.1%} below {min_gain:.0%}"
            return None
        position = max((r[0], r[1]) for r in rows)
        if accum > 1:  # new shares start with an accumulation window
            start = rows[0][2] - 1
            k = position[1]
            position = (position[0], start + -(-(k - start) // accum) * accum)
        return {"loader": i, "from": list(position), "shares": list(p.shares.per_rank), "global_batch": B}
