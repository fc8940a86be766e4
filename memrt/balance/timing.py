"""Timing windows of a DDP model's training steps under ``MEMRT=1``: the rank's own work, never its wait.

On the host, with the job's collectives on memrt's process group (where their waits are seen), a step's
window runs from the moment the previous step's gradient all-reduce completed on this rank (a callback chained
to each bucket's reduction) to the moment its last gradient bucket is handed to the comm hook, less the time
inside the hooks, in DDP's pre-forward (a buffer broadcast may wait for peers), in the job's own blocking
collectives (:mod:`memrt.comm.waits`) and in memrt's own exchanges. Everything a rank does between two
all-reduces is on the synchronous step's critical path, so the window holds it. Otherwise (CUDA, or
collectives memrt does not see) the window runs from the wrapped module's first training forward after the
all-reduce to the last bucket; on CUDA both marks are CUDA events on the current stream, read once completed
(no host sync). Every rank also times the forward-to-last-bucket window: a decision compares one kind.

A step ends at the first training forward after a gradient all-reduce; :class:`StepTimer` then hands the
window to its :class:`~memrt.balance.capability.ThroughputMeter` and calls ``on_step_end`` (the controller's
exchange, whose time is left out of the next window).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from memrt.balance.capability import ThroughputMeter
from memrt.comm.waits import waited_seconds

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["StepTimer"]

class StepTimer:
    """Times the steps of one DDP model (see the module docstring); feeds ``meter``."""

    def __init__(self, meter: ThroughputMeter, *, on_step_end: Callable[[], bool] | None = None) -> None:
        self.meter = meter
        self.on_step_end = on_step_end
        """Called when a step closed, before the next forward; True when it ran something (an exchange) whose
        time is then left out of the next window."""
        self.attached = False
        self.cuda = False
        self.between_all_reduces = False
        """Whether this rank times the window between all-reduces: on the host, with the job's collectives on
        memrt's process group (where their waits are seen); else forward to last bucket."""
        self.step_samples = 0
        """Samples of the step in progress (set by the controller at the step's first bucket)."""
        self.hook_seconds = 0.0
        """Seconds inside the comm hook this step (a wait for peers inside it is not work)."""
        self._in_step = False
        self._fwd_start: float | torch.cuda.Event | None = None
        """The step's forward mark: perf_counter() on the host, a recorded CUDA event on CUDA."""
        self._last_bucket: float | torch.cuda.Event | None = None
        self._hook_before_last = 0.0
        self._reduced_at: float | None = None
        """Host: perf_counter() when the latest bucket reduction completed (a comm thread sets it)."""
        self._origin: float | None = None
        """Host: start of the current step's window (the previous step's reduction done), None before one."""
        self._excluded = 0.0
        """Host: seconds inside the current window that are waits, not work (pre-forward, exchanges)."""
        self._outer_at: float | None = None
        self._waited_at_outer = 0.0
        self._waited_at_fwd = 0.0
        self._waited_at_bucket = 0.0
        """This thread's seconds waiting (memrt.comm.waits) at the latest bucket, before its hook."""
        self._waited_after_hook = 0.0
        """The same count when the latest bucket's hook returned (the last one's: at the window's start)."""
        self._waited_origin = 0.0
        self._pending_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int, float]] = []

    def attach(self, ddp: DistributedDataParallel, *, memrt_group: bool) -> None:
        """Time the steps of ``ddp``; ``memrt_group``: the job's default process group is memrt's."""
        self.attached = True
        param = next(iter(ddp.module.parameters()), None)
        self.cuda = param is not None and param.device.type == "cuda"
        self.between_all_reduces = not self.cuda and memrt_group
        ddp.register_forward_pre_hook(self.outer_pre_hook)
        ddp.module.register_forward_pre_hook(self.forward_pre_hook)

    # ------------------------------------------------------------------------------- marks from hooks
    def outer_pre_hook(self, _module: Any, _args: Any) -> None:
        self._outer_at, self._waited_at_outer = time.perf_counter(), waited_seconds()

    def forward_pre_hook(self, module: torch.nn.Module, _args: Any) -> None:
        import torch

        entered = time.perf_counter()
        outer, self._outer_at = self._outer_at, None
        if not (module.training and torch.is_grad_enabled()):
            return
        if self._in_step:  # first training forward after a gradient all-reduce
            self._in_step = False
            self._close_step()
            if self.on_step_end is not None and self.on_step_end():
                self._excluded += time.perf_counter() - entered
        if outer is not None:  # DDP's pre-forward: its buffer broadcast may wait for peers (a wait memrt.comm.waits
            # saw is left out of the window already)
            self._excluded += max(0.0, entered - outer - (waited_seconds() - self._waited_at_outer))
        if self._fwd_start is None:
            self._fwd_start = self._now()
            self._waited_at_fwd = waited_seconds()
            self.hook_seconds = self._hook_before_last = 0.0

    @property
    def in_step(self) -> bool:
        """True from a step's first gradient bucket to the next training forward."""
        return self._in_step

    def bucket_ready(self) -> bool:
        """A bucket of the timed model reached the comm hook; True for the first one of a step."""
        first = not self._in_step
        self._in_step = True
        self._last_bucket = self._now()
        self._hook_before_last = self.hook_seconds  # time inside earlier hook calls (may wait for peers)
        self._waited_at_bucket = waited_seconds()
        return first

    def hook_returned(self, seconds: float) -> None:
        """The comm hook returned for a bucket after ``seconds`` inside it."""
        self.hook_seconds += seconds
        self._waited_after_hook = waited_seconds()

    def reduction_done(self, future: torch.futures.Future) -> Any:
        """Chained after every bucket's reduction (host): note when it completed."""
        self._reduced_at = max(self._reduced_at or 0.0, time.perf_counter())
        return future.value()

    # ------------------------------------------------------------------------------------- windows
    def _now(self) -> float | torch.cuda.Event:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close_step(self) -> None:
        start, end, n = self._fwd_start, self._last_bucket, self.step_samples
        origin, excluded, waited = self._origin, self._excluded, self._waited_at_bucket
        self._origin, self._excluded = self._reduced_at, 0.0
        # the next window starts after this step's last hook returned (its reduction runs from there)
        self._waited_origin, origin_waited = self._waited_after_hook, self._waited_origin
        self._fwd_start = self._last_bucket = None
        if start is None or end is None or n <= 0 or not self.meter.admit():
            return
        if self.cuda:
            self._pending_events.append((start, end, n, self._hook_before_last))
            self._resolve_events()
            return
        forward = max(1e-9, end - start - (waited - self._waited_at_fwd))
        between = forward if origin is None else max(1e-9, end - origin - excluded - (waited - origin_waited))
        self.meter.record(n, between, forward)

    def _resolve_events(self, wait: bool = False) -> None:
        keep = []
        for start, end, n, hook_s in self._pending_events:
            if wait:
                end.synchronize()
            if end.query():
                seconds = max(1e-9, start.elapsed_time(end) / 1000.0 - hook_s)
                self.meter.record(n, seconds, seconds)
            else:
                keep.append((start, end, n, hook_s))
        self._pending_events = keep

    def samples_per_s(self, *, forward: bool = False) -> float | None:
        """The meter's median samples/s (CUDA: pending steps read first). ``forward``: timed from the forward
        to the last bucket. None before a timed step."""
        if self.cuda:
            self._resolve_events(wait=True)
        return self.meter.samples_per_s(forward=forward)
