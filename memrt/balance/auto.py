"""Zero-config balancing under ``MEMRT=1``: measure, agree, re-split the job's own global batches.

One :class:`Controller` per activated process (``MEMRT_BALANCE=auto|on``), composed of one part per job:

1. :class:`~memrt.balance.feed.LoaderFeed` holds the :class:`~memrt.balance.loader.ShareSampler` of every
   DataLoader the job built over a ``DistributedSampler`` (or accelerate's shard), which yield the stock
   batches until told otherwise, and gives the comm hook (:func:`memrt.balance.hook.weighted_allreduce_hook`,
   state from :meth:`Controller.hook_state`) the factor of the batch in this step: ``n_r * W / B`` for a
   mean-reduced loss under balanced shares, exactly 1 (no arithmetic at all) under stock shares;
2. :class:`~memrt.balance.timing.StepTimer` times every training step of the first balanced DDP model, the
   rank's own work only, never the wait for slower ranks, into a
   :class:`~memrt.balance.capability.ThroughputMeter` (the median samples/s of its latest ``speed_steps``
   timed steps, across exchanges);
3. :class:`~memrt.balance.exchange.StoreExchange`: at a few steps (after ``first_check`` steps,
   ``refine_after`` steps after every change, then every ``recheck_every`` steps) the ranks exchange, through
   the process group's store (no device collective), their samples/s, memory bound, the reduction of their
   loss (:mod:`memrt.balance.reduction`) and their DataLoaders' draw positions;
4. :class:`~memrt.balance.decision.ShareDecider`: every rank runs the same rule with the same hysteresis on
   the same numbers, and the feed schedules the new shares from the first batch no rank has drawn yet
   (aligned to gradient-accumulation windows).

Decisions go to rank 0's stderr and the report.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from memrt.balance.capability import ThroughputMeter
from memrt.balance.decision import AutoBalanceConfig, ShareDecider
from memrt.balance.exchange import KeyValueStore, StoreExchange
from memrt.balance.feed import LoaderFeed
from memrt.balance.hook import WeightedHookState
from memrt.balance.loader import ShareSampler
from memrt.balance.reduction import UNKNOWN, classify_loss, describe_loss
from memrt.balance.timing import StepTimer

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["AutoBalanceConfig", "Controller", "format_decision", "format_summary_line"]

logger = logging.getLogger("memrt.balance")

MemoryBound = Callable[[int], "int | None"]
"""(current local samples) -> most samples per step this rank's budget holds, or None."""


@dataclass(slots=True)
class _ModelTap:
    """The comm hook's observer for one DDP model: the step's factor; the timed model's marks."""

    controller: Controller
    is_timer: bool

    def bucket_ready(self) -> float:
        return self.controller.bucket_ready(self.is_timer)

    def hook_returned(self, seconds: float, future: torch.futures.Future) -> torch.futures.Future:
        if not self.is_timer:
            return future
        timer = self.controller.timer
        timer.hook_returned(seconds)
        return future if timer.cuda else future.then(timer.reduction_done)


class Controller:
    """Balancing for one activated process; see the module docstring. Every rank builds one."""

    def __init__(self, *, store: KeyValueStore, rank: int, world: int, config: AutoBalanceConfig,
                 memory_bound: MemoryBound | None = None) -> None:
        self.rank = rank
        self.world = world
        self.config = config
        self.memory_bound = memory_bound
        """Callable (current local samples) -> most samples per step this rank's budget holds, or None."""
        self.feed = LoaderFeed(world)
        self.timer = StepTimer(ThroughputMeter(window_steps=config.speed_steps, warmup_steps=config.warmup_steps),
                               on_step_end=self._step_ended)
        self.exchange = StoreExchange(store, rank=rank, world=world, prefix="balance",
                                      timeout_s=config.exchange_timeout_s)
        self.decider = ShareDecider(config, world)
        self.steps = 0
        """Gradient all-reduces seen on the timed model (training steps)."""
        self.enabled = True
        self.decisions: list[dict[str, Any]] = []
        self.reductions: set[str] = set()
        self._unknown_root = ""
        self._next_check = config.first_check
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------- DataLoaders
    def add_loader(self, sampler: ShareSampler) -> None:
        self.feed.add(sampler)

    def skip_loader(self, reason: str) -> None:
        self.feed.skip(reason)

    @property
    def loaders(self) -> list[ShareSampler | None]:
        """The share samplers by creation index; None where the DataLoader is gone."""
        return self.feed.loaders

    @property
    def skipped(self) -> dict[str, int]:
        """Why DataLoaders were left as they are -> how many."""
        return self.feed.skipped

    # ------------------------------------------------------------------------------- the DDP hook
    @property
    def timing_attached(self) -> bool:
        """Whether a DDP model's steps are timed already (the first balanced model is)."""
        return self.timer.attached

    def attach_timer(self, ddp: DistributedDataParallel) -> None:
        """Time the steps of ``ddp`` (a DistributedDataParallel model)."""
        if self.timer.attached:
            return
        from memrt.comm.backend import default_is_memrt

        self.timer.attach(ddp, memrt_group=default_is_memrt())

    def hook_state(self, *, inner_hook: Callable[..., Any], inner_state: Any, is_timer: bool) -> WeightedHookState:
        """The comm hook's state for one DDP model: this controller's factor, then ``inner_hook`` (averaging)."""
        return WeightedHookState(inner_hook=inner_hook, inner_state=inner_state, world_size=self.world,
                                 observer=_ModelTap(self, is_timer))

    def bucket_ready(self, is_timer: bool) -> float:
        """Called by the hook for every bucket: mark the step, note time, return this step's factor."""
        if is_timer:
            if not self.timer.in_step:
                self.steps += 1
                self.timer.step_samples = self.feed.mark_step()
            self.timer.bucket_ready()
        return self.feed.factor

    @property
    def cuda(self) -> bool:
        return self.timer.cuda

    @property
    def between_all_reduces(self) -> bool:
        return self.timer.between_all_reduces

    def _step_ended(self) -> bool:
        """A step closed (next forward): exchange when one is due; True when it did."""
        if not (self.enabled and self.steps >= self._next_check):
            return False
        self.check()
        return True

    # -------------------------------------------------------------------------------- loss kinds
    def observe_backward(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """``torch.autograd.backward``'s first argument: what kind of reduction the loss has."""
        try:
            kind = classify_loss(tensors)
            if kind == UNKNOWN and not self._unknown_root:
                self._unknown_root = describe_loss(tensors)
        except Exception:  # noqa: BLE001 - never break the user's backward
            kind = UNKNOWN
        self.reductions.add(kind)

    # ------------------------------------------------------------------------ exchange, decision
    def figures(self) -> dict[str, Any]:
        """This rank's figures for the exchange."""
        bound = None
        if self.memory_bound is not None:
            try:
                bound = self.memory_bound(self.feed.step_samples or 1)
            except Exception as exc:  # noqa: BLE001
                self._warn_once(f"memory bound unavailable ({exc}): shares are not bounded by the budget")
        kinds = self.reductions or {UNKNOWN}
        return {
            "sps": self.timer.samples_per_s(), "sps_forward": self.timer.samples_per_s(forward=True),
            "between": self.timer.between_all_reduces, "bound": bound,
            "reduction": kinds.pop() if len(kinds) == 1 else UNKNOWN, "root": self._unknown_root,
            "accum": self.feed.accum, "loaders": self.feed.figures(),
        }

    def check(self) -> None:
        """Exchange figures, decide, apply (every rank at the same step)."""
        try:
            everyone = self.exchange.gather(self.figures())
        except Exception as exc:  # noqa: BLE001 - a rank that cannot exchange keeps the agreed shares
            self.enabled = False
            logger.warning("memrt: balance: exchanging speeds failed on rank %d (%s); shares stay as they are",
                           self.rank, exc)
            return
        self.reductions.clear()
        decision = self.decide(everyone)
        self.decisions.append(decision)
        soon = decision["changed"] or decision.get("confirm") or decision["reason"] == "speeds not measured yet"
        self._next_check = self.steps + (self.config.refine_after if soon else self.config.recheck_every)
        if decision["changed"]:
            self.timer.meter.skip(self.config.warmup_steps + self.feed.lag_steps())
        if self.rank == 0 and (decision["changed"] or decision.get("warn")):
            sys.stderr.write(format_decision(decision) + "\n")
            sys.stderr.flush()

    def decide(self, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        """The decision on every rank's figures, its new shares scheduled on the DataLoaders."""
        decision = self.decider.decide(everyone, step=self.steps, loaders=self.feed.loaders,
                                       skipped=self.feed.skipped)
        if decision["changed"]:
            self.feed.apply(decision)
        return decision

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            logger.warning("memrt: balance: %s", text)

    def report(self) -> dict[str, Any]:
        """What the rank report shows."""
        last = next((d for d in reversed(self.decisions) if d.get("shares")), None)
        return {"mode": self.config.mode, "steps": self.steps, "enabled": self.enabled,
                "balanced_loaders": len(self.loaders), "skipped_loaders": dict(self.skipped),
                "shares": last["shares"] if last else None,
                "samples_per_s": self.decisions[-1]["samples_per_s"] if self.decisions else None,
                "decisions": self.decisions, "local_samples": self.feed.samples_seen(),
                "config": asdict(self.config)}


def format_summary_line(ctl: Controller) -> str:
    """One line for rank 0's summary at exit: the shares in force and the speeds they came from."""
    r = ctl.report()
    if r["shares"] is None or not any(d["changed"] for d in ctl.decisions):
        last = ctl.decisions[-1]["reason"] if ctl.decisions else "no decision taken (too few steps)"
        return f"memrt: balance ({r['mode']}): stock split kept: {last}"
    last = next(d for d in reversed(ctl.decisions) if d["changed"])
    speeds = ", ".join("-" if s is None else f"{s:.1f}" for s in last["samples_per_s"])
    return (f"memrt: balance ({r['mode']}): shares {r['shares']} per global batch (samples/s per rank {speeds}, "
            f"predicted step time -{100 * last['predicted_gain']:.0f}%); {len(ctl.decisions)} decision(s)")


def format_decision(d: dict[str, Any]) -> str:
    speeds = ", ".join("-" if s is None else f"{s:.1f}" for s in d["samples_per_s"])
    if d["changed"]:
        return (f"memrt: balance: step {d['step']}: shares {d['shares']} of {d['loaders'][0]['global_batch']} "
                f"from batch {d['loaders'][0]['from'][1]} (samples/s per rank {speeds}; predicted step time "
                f"-{100 * d['predicted_gain']:.0f}%; loss {d.get('reduction')})"
                f"{' ' + d['assumed'] if d.get('assumed') else ''}")
    return f"memrt: balance: step {d['step']}: left unbalanced: {d['reason']} (samples/s per rank {speeds})"


