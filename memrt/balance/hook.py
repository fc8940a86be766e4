"""DDP comm hook for speed-weighted data parallelism: weight b_r/B, then SUM.

DDP's default hook divides every gradient by the world size and sums (AVG): right only when every rank
holds the same number of samples. With rank r holding b_r of the global batch B and its loss the mean
over its b_r samples, the full-batch mean gradient is ``sum_r (b_r / B) * g_r``; this hook multiplies the
bucket by ``b_r / B`` and all-reduces with SUM.

Composition: when an inner hook is given (memrt's topology-aware ``memrt.comm.ddp_comm_hook``, or any
hook that averages like DDP's default), the bucket is pre-scaled by ``W * b_r / B`` so the inner
hook's division by W leaves exactly the weighted sum. With ``inner_averages=False`` the inner hook is
taken to sum. Mixed device kinds: a :class:`memrt.comm.mixed.MixedComm` stages through host memory
when the members share no device backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["WeightedHookState", "weighted_allreduce_hook"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class WeightedHookState:
    """What the hook needs; the balancer updates ``weight`` at every step boundary."""

    weight: float
    """b_r / B for this rank and this step (a plain float, identical for all buckets of the step)."""
    world_size: int
    """Ranks in ``group`` (used to undo an averaging inner hook)."""
    group: Any = None
    """Process group of the all-reduce; None = the default group."""
    inner_hook: Callable[[Any, Any], Any] | None = None
    """Hook that does the actual reduction (memrt.comm's topology-aware one); None = torch all_reduce."""
    inner_state: Any = None
    """State passed to ``inner_hook``."""
    inner_averages: bool = True
    """True when ``inner_hook`` divides by the world size (as DDP's default and memrt.comm's hooks do)."""
    mixed: Any = None
    """A ``memrt.comm.mixed.MixedComm`` for groups of mixed device kinds; None = plain torch.distributed."""
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


def weighted_allreduce_hook(state: WeightedHookState, bucket):  # DDP checks annotations: keep bucket bare
    """``DistributedDataParallel.register_comm_hook(state, weighted_allreduce_hook)``."""
    import torch.distributed as dist

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
    try:
        if state.inner_hook is not None:
            buf.mul_(state.weight * state.world_size if state.inner_averages else state.weight)
            return state.inner_hook(state.inner_state, bucket)
        buf.mul_(state.weight)
        if state.mixed is not None:
            return state.mixed.all_reduce_future(buf)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    finally:
        state.blocked_s += time.perf_counter() - start
