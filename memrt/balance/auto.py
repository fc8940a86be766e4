"""Zero-config balancing under ``MEMRT=1``: measure, agree, re-split the job's own global batches.

One :class:`Controller` per activated process (``MEMRT_BALANCE=auto|on``). It

1. owns the :class:`~memrt.balance.loader.ShareSampler` of every DataLoader the job built over a
   ``DistributedSampler`` (or accelerate's shard), which yield the stock batches until told otherwise;
2. times every training step of the DDP model it is attached to, the rank's own work only, never the wait
   for slower ranks: on the host, with the job's collectives on memrt's process group, from the moment the
   previous step's gradient all-reduce completed (what the rank does between steps — copying the reduced
   gradients back, the optimizer step, drawing the next batch — is on the synchronous step's critical path)
   to the last gradient bucket handed to the comm hook, less the time inside the hooks, in DDP's pre-forward
   (a buffer broadcast may wait for peers), in the job's own blocking collectives (:mod:`memrt.comm.waits`:
   a loss all-reduced for logging, a barrier, SyncBatchNorm) and in memrt's own exchanges; otherwise (CUDA,
   or collectives memrt does not see) from the wrapped module's first forward after the all-reduce to the
   last bucket, on CUDA with events recorded on the current stream, read once they have completed. Every
   rank also times the forward-to-last-bucket window, and a decision compares one kind of window: the
   forward one as soon as one rank cannot time between all-reduces;
3. at a few steps (after ``first_check`` steps, ``refine_after`` steps after every change, then every
   ``recheck_every`` steps) exchanges, through the process group's store (no device collective), each rank's
   samples/s (the median of its latest ``speed_steps`` timed steps, across exchanges), memory bound, the
   reduction of its loss (:mod:`memrt.balance.reduction`) and its DataLoaders' draw positions; every rank then
   runs the same rule on the same numbers (:func:`memrt.balance.shares.decide_shares`: shares in proportion to
   the samples/s measured at the shares in force) and schedules the new shares from the first batch no rank has
   drawn yet (aligned to gradient-accumulation windows). Repeated, the rule settles where the ranks' step
   times are equal, per-step fixed costs included: a rank with a fixed cost is slower per sample at a smaller
   share, and the next decision gives it fewer samples still;
4. gives the comm hook (:func:`balanced_hook`) the factor of the batch in this step: ``n_r * W / B`` for a
   mean-reduced loss under balanced shares, exactly 1 (no arithmetic at all) under stock shares.

Hysteresis: the stock split is left only when the predicted step time drops by ``min_gain``, the fastest
rank is ``min_speed_ratio`` x the slowest and the next exchange confirms it (on more steps); a balanced split
moves when the predicted step time drops by ``refine_gain`` (``MEMRT_BALANCE=on``: no thresholds, and an
unknown loss reduction is taken to be a mean). Decisions go to rank 0's stderr and the report.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from memrt.balance.loader import ShareSampler
from memrt.balance.reduction import MEAN, SUM, UNKNOWN, classify_loss, describe_loss
from memrt.balance.shares import Shares, decide_shares, predicted_step_seconds, uniform_shares
from memrt.comm.waits import waited_seconds, waiting

__all__ = ["AutoBalanceConfig", "Controller", "BalanceHookState", "balanced_hook"]

logger = logging.getLogger("memrt.balance")


@dataclass(kw_only=True, slots=True)
class AutoBalanceConfig:
    """How the controller measures and decides."""

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
        for name in ("min_gain", "refine_gain"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} is not valid: expected a fraction in [0, 1)")


@dataclass(kw_only=True, slots=True)
class _Timing:
    samples: int = 0
    seconds: float = 0.0
    """The step's window: between all-reduces on the host, forward to last bucket on CUDA."""
    forward_seconds: float = 0.0
    """Forward to last bucket (what every rank can time, the host as CUDA)."""


@dataclass(kw_only=True, slots=True)
class BalanceHookState:
    """State of :func:`balanced_hook`: the controller and the reduction it wraps."""

    controller: "Controller"
    inner_hook: Any
    """The hook that averages and reduces (memrt.comm's, or torch's default allreduce_hook)."""
    inner_state: Any
    is_timer: bool = False
    """True for the DDP model whose steps the controller times."""


def balanced_hook(state: BalanceHookState, bucket):  # DDP checks annotations: keep bucket bare
    """Scale the bucket by this step's factor (skipped when it is 1), then the inner hook."""
    ctl = state.controller
    start = time.perf_counter()
    factor = ctl.bucket_ready(state.is_timer, bucket)
    with waiting():  # memrt's time in the hook, a wait inside it included, is not the rank's work
        if factor != 1.0:
            bucket.buffer().mul_(factor)
        try:
            future = state.inner_hook(state.inner_state, bucket)
        finally:
            if state.is_timer:
                ctl.hook_seconds += time.perf_counter() - start
    if not state.is_timer:
        return future
    ctl.hook_returned()
    return future if ctl.cuda else future.then(ctl.reduction_done)


class Controller:
    """Balancing for one activated process; see the module docstring. Every rank builds one."""

    def __init__(self, *, store: Any, rank: int, world: int, config: AutoBalanceConfig,
                 memory_bound: Any = None) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.config = config
        self.memory_bound = memory_bound
        """Callable (current local samples) -> most samples per step this rank's budget holds, or None."""
        self._loaders: list[weakref.ref[ShareSampler]] = []
        """Share samplers in creation order (the same order on every rank); weak: a dropped DataLoader goes."""
        self.skipped: dict[str, int] = {}
        """Why DataLoaders were left as they are -> how many."""
        self.steps = 0
        """Gradient all-reduces seen on the timed model (training steps)."""
        self.enabled = True
        self.decisions: list[dict[str, Any]] = []
        self.reductions: set[str] = set()
        self._unknown_root = ""
        self.hook_seconds = 0.0
        self._timed = False
        self._in_step = False
        self._fwd_start: Any = None
        self._last_bucket: Any = None
        self._reduced_at: float | None = None
        """Host: perf_counter() when the timed model's latest bucket reduction completed (a comm thread sets it)."""
        self._origin: float | None = None
        """Host: start of the current step's window (the previous step's reduction done), None before one."""
        self._excluded = 0.0
        """Host: seconds inside the current window that are waits, not work (pre-forward, exchanges)."""
        self._outer_at: float | None = None
        self._waited_at_outer = 0.0
        self._waited_at_fwd = 0.0
        self._waited_at_bucket = 0.0
        """Host: this thread's seconds waiting (memrt.comm.waits: the job's collectives, memrt's hooks) at the
        latest bucket, before its hook."""
        self._waited_after_hook = 0.0
        """Host: the same count when the latest bucket's hook returned (the last one's: at the window's start)."""
        self._waited_origin = 0.0
        self.cuda = False
        self.between_all_reduces = False
        """Whether this rank times the window between all-reduces: on the host, with the job's collectives on
        memrt's process group (where their waits are seen); else forward to last bucket."""
        self._pending_events: list[tuple[Any, Any, int, float]] = []
        self._window: deque[_Timing] = deque(maxlen=config.speed_steps)
        self._hook_before_last = 0.0
        self._skip = config.warmup_steps
        self._next_check = config.first_check
        self._checks = 0
        self._confirmed = False
        """True when the previous check also found that leaving the stock split would pay."""
        self._marks: dict[int, tuple[int, int]] = {}
        self._accum = 1
        self._step_samples = 0
        self._version = 0
        self._warned: set[str] = set()
        self._factor = 1.0
        """Gradient factor of this step's batch (n_r * W / B, or exactly 1 under the stock split)."""

    # ------------------------------------------------------------------------------------ DataLoaders
    def add_loader(self, sampler: ShareSampler) -> None:
        self._loaders.append(weakref.ref(sampler))

    @property
    def loaders(self) -> list[ShareSampler | None]:
        """The share samplers by creation index; None where the DataLoader is gone."""
        return [ref() for ref in self._loaders]

    def skip_loader(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    # ---------------------------------------------------------------------------------------- timing
    def attach_timer(self, ddp: Any) -> None:
        """Time the steps of ``ddp`` (a DistributedDataParallel model)."""
        if self._timed:
            return
        self._timed = True
        from memrt.comm.backend import default_is_memrt

        param = next(iter(ddp.module.parameters()), None)
        self.cuda = param is not None and param.device.type == "cuda"
        self.between_all_reduces = not self.cuda and default_is_memrt()
        ddp.register_forward_pre_hook(self._outer_pre_hook)
        ddp.module.register_forward_pre_hook(self._forward_pre_hook)

    def hook_returned(self) -> None:
        """The timed model's comm hook returned for a bucket."""
        self._waited_after_hook = waited_seconds()

    def reduction_done(self, future: Any) -> Any:
        """Chained after every bucket's reduction of the timed model (host): note when it completed."""
        self._reduced_at = max(self._reduced_at or 0.0, time.perf_counter())
        return future.value()

    def _outer_pre_hook(self, _module: Any, _args: Any) -> None:
        self._outer_at, self._waited_at_outer = time.perf_counter(), waited_seconds()

    def _now(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _forward_pre_hook(self, module: Any, _args: Any) -> None:
        import torch

        entered = time.perf_counter()
        outer, self._outer_at = self._outer_at, None
        if not (module.training and torch.is_grad_enabled()):
            return
        if self._in_step:  # first training forward after a gradient all-reduce
            self._in_step = False
            self._close_step()
            if self.enabled and self.steps >= self._next_check:
                self._check()
                self._excluded += time.perf_counter() - entered
        if outer is not None:  # DDP's pre-forward: its buffer broadcast may wait for peers (a wait memrt.comm.waits
            # saw is left out of the window already)
            self._excluded += max(0.0, entered - outer - (waited_seconds() - self._waited_at_outer))
        if self._fwd_start is None:
            self._fwd_start = self._now()
            self._waited_at_fwd = waited_seconds()
            self.hook_seconds = self._hook_before_last = 0.0

    def bucket_ready(self, is_timer: bool, bucket: Any) -> float:
        """Called by the hook for every bucket: mark the step, note time, return this step's factor."""
        if is_timer:
            if not self._in_step:
                self._in_step = True
                self.steps += 1
                self._mark_trained_loaders()
            self._last_bucket = self._now()
            self._hook_before_last = self.hook_seconds  # time inside earlier hook calls (may wait for peers)
            self._waited_at_bucket = waited_seconds()
        return self._factor

    def _mark_trained_loaders(self) -> None:
        """Loaders whose batches were consumed since the last all-reduce fed this step."""
        factors, samples, consumed = set(), 0, 0
        for i, s in enumerate(self.loaders):
            if s is None:
                continue
            mark = (s.iteration, s.consumed)
            if mark != self._marks.get(i) and s.current is not None:
                s.trained = True
                before = self._marks.get(i)
                consumed = s.consumed - (before[1] if before and before[0] == s.iteration else 0)
                factors.add(s.current[0])
                samples += s.current[1] * max(1, consumed)
            self._marks[i] = mark
        if consumed > 0:
            self._accum = consumed
        self._step_samples = samples or 1  # no balanced DataLoader: steps/s (ranks take equal batches)
        if len(factors) > 1:
            self._warn_once("several DataLoaders with different shares fed one step: their gradients are "
                            "weighted by the first one's share")
        self._factor = next(iter(factors)) if factors else 1.0

    def _close_step(self) -> None:
        start, end, n = self._fwd_start, self._last_bucket, self._step_samples
        origin, excluded, waited = self._origin, self._excluded, self._waited_at_bucket
        self._origin, self._excluded = self._reduced_at, 0.0
        # the next window starts after this step's last hook returned (its reduction runs from there)
        self._waited_origin, origin_waited = self._waited_after_hook, self._waited_origin
        self._fwd_start = self._last_bucket = None
        if start is None or end is None or n <= 0:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        if self.cuda:
            self._pending_events.append((start, end, n, self._hook_before_last))
            self._resolve_events()
            return
        forward = max(1e-9, end - start - (waited - self._waited_at_fwd))
        between = forward if origin is None else max(1e-9, end - origin - excluded - (waited - origin_waited))
        self._add(n, between, forward)

    def _resolve_events(self, wait: bool = False) -> None:
        keep = []
        for start, end, n, _hook_s in self._pending_events:
            if wait:
                end.synchronize()
            if end.query():
                seconds = max(1e-9, start.elapsed_time(end) / 1000.0 - _hook_s)
                self._add(n, seconds, seconds)
            else:
                keep.append((start, end, n, _hook_s))
        self._pending_events = keep

    def _add(self, n: int, seconds: float, forward_seconds: float) -> None:
        self._window.append(_Timing(samples=n, seconds=seconds, forward_seconds=forward_seconds))

    def samples_per_s(self, *, forward: bool = False) -> float | None:
        """The median samples/s of the latest ``speed_steps`` timed steps (the steps right after a change, until
        it took effect, are not timed); a step that also ran something else, an evaluation or a checkpoint,
        does not move it. ``forward``: timed from the forward to the last bucket. None before one."""
        if self.cuda:
            self._resolve_events(wait=True)
        rates = [t.samples / (t.forward_seconds if forward else t.seconds) for t in self._window if t.seconds > 0]
        return statistics.median(rates) if rates else None

    # ----------------------------------------------------------------------------------- loss kinds
    def observe_backward(self, tensors: Any) -> None:
        """``torch.autograd.backward``'s first argument: what kind of reduction the loss has."""
        try:
            kind = classify_loss(tensors)
            if kind == UNKNOWN and not self._unknown_root:
                self._unknown_root = describe_loss(tensors)
        except Exception:  # noqa: BLE001 - never break the user's backward
            kind = UNKNOWN
        self.reductions.add(kind)

    # -------------------------------------------------------------------------------------- exchange
    def _mine(self) -> dict[str, Any]:
        local = self._step_samples or 1
        bound = None
        if self.memory_bound is not None:
            try:
                bound = self.memory_bound(local)
            except Exception as exc:  # noqa: BLE001
                self._warn_once(f"memory bound unavailable ({exc}): shares are not bounded by the budget")
        kinds = self.reductions or {UNKNOWN}
        return {
            "sps": self.samples_per_s(), "sps_forward": self.samples_per_s(forward=True),
            "between": self.between_all_reduces, "bound": bound,
            "reduction": kinds.pop() if len(kinds) == 1 else UNKNOWN, "root": self._unknown_root,
            "accum": self._accum,
            "loaders": [[-2, 0, 0, False, 0] if s is None else [s.iteration, s.drawn, s.consumed, s.trained,
                                                                  s.full_batch()] for s in self.loaders],
        }

    def _exchange(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        key = f"balance/{self._checks}"
        self.store.set(f"{key}/{self.rank}", json.dumps(mine))
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.store.wait(keys, timedelta(seconds=self.config.exchange_timeout_s))
        everyone = [json.loads(self.store.get(k)) for k in keys]
        if self._checks > 1:  # every rank read the previous exchange before posting to this one
            try:
                self.store.delete_key(f"balance/{self._checks - 1}/{self.rank}")
            except Exception:  # noqa: BLE001 - a store without deletion keeps a few bytes per check
                pass
        return everyone

    def _check(self) -> None:
        self._checks += 1
        try:
            everyone = self._exchange(self._mine())
        except Exception as exc:  # noqa: BLE001 - a rank that cannot exchange keeps the agreed shares
            self.enabled = False
            logger.warning("memrt: balance: exchanging speeds failed on rank %d (%s); shares stay as they are",
                           self.rank, exc)
            return
        self.reductions.clear()
        decision = self._decide(everyone)
        self.decisions.append(decision)
        soon = decision["changed"] or decision.get("confirm") or decision["reason"] == "speeds not measured yet"
        self._next_check = self.steps + (self.config.refine_after if soon else self.config.recheck_every)
        if decision["changed"]:
            self._skip = self.config.warmup_steps + self._lag_steps()
        if self.rank == 0 and (decision["changed"] or decision.get("warn")):
            sys.stderr.write(format_decision(decision) + "\n")
            sys.stderr.flush()

    def _lag_steps(self) -> int:
        """Batches already drawn ahead of the training loop (prefetch): new shares arrive that much later."""
        return max((s.drawn - s.consumed for s in self.loaders if s is not None and s.trained), default=0)

    def _decide(self, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        """The same decision on every rank from the same gathered figures."""
        between = all(p["between"] for p in everyone)  # one kind of window for every rank
        speeds = [p["sps" if between else "sps_forward"] for p in everyone]
        bounds = [p["bound"] for p in everyone]
        out: dict[str, Any] = {"step": self.steps, "samples_per_s": speeds, "max_samples": bounds,
                               "timed": "between all-reduces" if between else "forward to last bucket",
                               "changed": False, "shares": None, "predicted_gain": 0.0, "reason": ""}
        kinds = {p["reduction"] for p in everyone}
        if any(s is None or s <= 0 for s in speeds):
            out["reason"] = "speeds not measured yet"
            return out
        counts = {len(p["loaders"]) for p in everyone}
        trained = [i for i in range(min(counts)) if all(p["loaders"][i][3] for p in everyone)] if counts else []
        ratio = max(speeds) / min(speeds)
        out["speed_ratio"] = ratio
        pays = self.config.mode == "on" or ratio >= self.config.min_speed_ratio
        if len(counts) != 1 or not trained:
            why = ("the ranks built different DataLoaders" if len(counts) > 1 else
                   "no DataLoader over a DistributedSampler (or accelerate shard) fed the training steps"
                   + (f"; left as they were: {', '.join(sorted(self.skipped))}" if self.skipped else ""))
            out["reason"] = why
            out["warn"] = pays and "no-loader" not in self._warned
            self._warned.add("no-loader")
            return out
        if kinds == {MEAN} or kinds == {SUM}:
            kind = kinds.pop()
        elif self.config.mode == "on" and SUM not in kinds:
            kind = MEAN
            out["assumed"] = "loss reduction unknown: taken as a mean (MEMRT_BALANCE=on)"
        else:
            roots = sorted({p["root"] for p in everyone if p.get("root")})
            out["reason"] = (f"the loss reduction cannot be known (seen: {', '.join(sorted(kinds))}"
                             f"{'; backward from ' + roots[0] if roots else ''}): memrt sees only the tensor "
                             "backward() starts from; MEMRT_BALANCE=on balances assuming a mean-reduced loss")
            out["warn"] = pays and "reduction" not in self._warned
            self._warned.add("reduction")
            return out
        out["reduction"] = kind
        per_loader = []
        accum = max(p["accum"] for p in everyone)
        for i in trained:
            rows = [p["loaders"][i] for p in everyone]
            if len({r[4] for r in rows}) != 1 or len({r[0] for r in rows}) != 1:
                continue
            B = rows[0][4]
            sampler = self.loaders[i]
            if sampler is None:
                continue
            current = sampler.shares_now()
            current_shares = (uniform_shares(B, self.world) if current is None
                              else Shares(per_rank=tuple(current), global_batch=B))
            try:
                proposal = decide_shares(B, speeds, bounds)
            except ValueError as exc:
                out["reason"] = str(exc)
                continue
            gain = 1.0 - predicted_step_seconds(proposal, speeds) / predicted_step_seconds(current_shares, speeds)
            over = any(m is not None and b > m for b, m in zip(current_shares.per_rank, bounds))
            if self.config.mode == "on":
                min_gain = 0.0
            else:
                min_gain = self.config.min_gain if current is None else self.config.refine_gain
            leaving_stock = current is None
            adopt = proposal != current_shares and (over or (gain > min_gain and (pays or not leaving_stock)))
            if adopt and leaving_stock and not over and self.config.mode == "auto" and not self._confirmed:
                adopt = False  # leave the stock split only when the next exchange confirms it (noise)
                out["confirm"] = True
            out["predicted_gain"] = gain
            out["shares"] = list(proposal.per_rank if adopt else current_shares.per_rank)
            if not adopt:
                if out.get("confirm"):
                    out["reason"] = "an imbalance to confirm at the next exchange"
                elif not pays:
                    out["reason"] = f"speeds within {self.config.min_speed_ratio:.2f}x"
                else:
                    out["reason"] = f"predicted gain {gain:.1%} below {min_gain:.0%}"
                continue
            new = None if proposal == uniform_shares(B, self.world) else proposal.per_rank
            position = max((r[0], r[1]) for r in rows)
            if accum > 1:  # new shares start with an accumulation window
                start = rows[0][2] - 1
                k = position[1]
                position = (position[0], start + -(-(k - start) // accum) * accum)
            sampler.schedule(position, new, kind)
            per_loader.append({"loader": i, "from": list(position), "shares": list(proposal.per_rank),
                               "global_batch": B})
            out["changed"] = True
        out["loaders"] = per_loader
        self._confirmed = bool(out.get("confirm"))
        return out

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
                "decisions": self.decisions,
                "local_samples": [None if s is None else s.samples_seen for s in self.loaders],
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
                f"-{100 * d['predicted_gain']:.0f}%; loss {d.get('reduction')}){' ' + d['assumed'] if d.get('assumed') else ''}")
    return f"memrt: balance: step {d['step']}: left unbalanced: {d['reason']} (samples/s per rank {speeds})"


