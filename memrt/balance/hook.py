"""The one DDP comm hook of speed-weighted data parallelism: scale the bucket, then reduce.

DDP's default hook divides every gradient by the world size and sums (AVG): right only when every rank
holds the same number of samples. With rank r holding b_r of the global batch B and its loss the mean
over its b_r samples, the full-batch mean gradient is ``sum_r (b_r / B) * g_r``. The hook multiplies the
bucket by a scale and hands it to the reduction; a scale of exactly 1 does no arithmetic at all.

- The scale: a ``SpeedBalancer``'s ``weight`` (b_r / B) before a SUM all-reduce, or ``W * b_r / B`` before
  an inner hook that averages (memrt.comm's topology-aware ``ddp_comm_hook``, torch's default
  ``allreduce_hook``; ``inner_averages=False``: it sums); under ``MEMRT=1`` the ``observer`` (the
  controller) gives the factor of the batch that was in this step's forward (``n_r * W / B``, exactly 1
  under the stock split) and times the step.
- The reduction: the inner hook, else a :class:`memrt.comm.mixed.MixedComm` (host staging for mixed device
  kinds), else ``torch.distributed.all_reduce(SUM)`` over ``group``.

Under an observer the hook's time, a wait for slower ranks inside it included, is counted as a wait
(:func:`memrt.comm.waits.waiting`), not as the rank's work.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed import GradBucket, ProcessGroup

    from memrt.comm.mixed import MixedComm

__all__ = ["BucketObserver", "WeightedHookState", "weighted_allreduce_hook"]


class BucketObserver(Protocol):
    """Who decides a bucket's factor and watches the hook (``MEMRT=1``'s controller, per DDP model)."""

    def bucket_ready(self) -> float:
        """A bucket reached the hook: the factor to scale it by (exactly 1.0: no arithmetic)."""
        ...

    def hook_returned(self, seconds: float, future: torch.futures.Future) -> torch.futures.Future:
        """The reduction was handed on after ``seconds`` in the hook; returns the future DDP gets."""
        ...


@dataclass(kw_only=True, slots=True)
class WeightedHookState:
    """What the hook needs; a ``SpeedBalancer`` updates ``weight`` at every step boundary."""

    weight: float = 1.0
    """b_r / B for this rank and this step (a plain float, identical for all buckets of the step)."""
    world_size: int = 1
    """Ranks in ``group`` (used to undo an averaging inner hook)."""
    group: ProcessGroup | None = None
    """Process group of the all-reduce; None = the default group."""
    inner_hook: Callable[[Any, GradBucket], torch.futures.Future] | None = None
    """Hook that does the actual reduction (memrt.comm's topology-aware one); None = torch all_reduce."""
    inner_state: Any = None
    """State passed to ``inner_hook`` (whatever that hook takes)."""
    inner_averages: bool = True
    """True when ``inner_hook`` divides by the world size (as DDP's default and memrt.comm's hooks do)."""
    mixed: MixedComm | None = None
    """A ``memrt.comm.mixed.MixedComm`` for groups of mixed device kinds; None = plain torch.distributed."""
    observer: BucketObserver | None = None
    """``MEMRT=1``: gives each bucket's factor instead of ``weight`` and times the step; None = ``weight``."""
    step_start_s: float = 0.0
    """perf_counter() at the start of the current step (set by the balancer)."""
    forward_start_s: float | None = None
    """perf_counter() when the wrapped module's forward began this step (after DDP's buffer broadcast, which
    waits for slower ranks); None until then."""
    compute_s: float | None = None
    """Seconds of local compute up to the latest ready bucket this step, hook time excluded; None before one."""
    buckets_this_step: int = 0
    """Buckets seen since the balancer's last step boundary."""
    blocked_s: float = 0.0
    """Seconds spent inside the hook this step (an inner hook may block on slower ranks): not compute."""

    def start_step(self, weight: float, start_s: float) -> None:
        self.weight = weight
        self.step_start_s = start_s
        self.forward_start_s = None
        self.compute_s = None

    def note_forward(self) -> None:
        """Forward pre-hook of the wrapped module: compute starts here (first forward of the step)."""
        if self.forward_start_s is None:
            self.forward_start_s = time.perf_counter()
        self.buckets_this_step = 0
        self.blocked_s = 0.0

    def scale(self) -> float:
        """The factor on this bucket: the observer's, else ``weight`` (x W before an averaging inner hook)."""
        if self.observer is not None:
            return self.observer.bucket_ready()
        if self.inner_hook is not None and self.inner_averages:
            return self.weight * self.world_size
        return self.weight


def _reduce(state: WeightedHookState, bucket: GradBucket, buf: torch.Tensor) -> torch.futures.Future:
    if state.inner_hook is not None:
        return state.inner_hook(state.inner_state, bucket)
    if state.mixed is not None:
        return state.mixed.all_reduce_future(buf)
    import torch.distributed as dist

    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _waiting(state: WeightedHookState) -> ContextManager[None]:
    if state.observer is None:
        return contextlib.nullcontext()
    from memrt.comm.waits import waiting  # MEMRT=1 only: the explicit API does not need memrt.comm

    return waiting()


def weighted_allreduce_hook(state: WeightedHookState, bucket):  # DDP checks annotations: keep bucket bare
    """``DistributedDataParallel.register_comm_hook(state, weighted_allreduce_hook)``."""
    buf = bucket.buffer()
    if state.mixed is not None and state.mixed.staging and buf.is_cuda:
        import torch

        # the staging copy to host would wait for the backward queued so far: that wait is compute (it ends
        # here, before the clock starts), not time blocked on slower ranks
        torch.cuda.current_stream(buf.device).synchronize()
    start = time.perf_counter()
    begin = state.forward_start_s if state.forward_start_s is not None else state.step_start_s
    state.compute_s = start - begin - state.blocked_s
    state.buckets_this_step += 1
    factor = state.scale()
    with _waiting(state):  # memrt's time in the hook, a wait inside it included, is not the rank's work
        try:
            if factor != 1.0:
                buf.mul_(factor)
            future = _reduce(state, bucket, buf)
        finally:
            seconds = time.perf_counter() - start
            state.blocked_s += seconds
    return future if state.observer is None else state.observer.hook_returned(seconds, future)
