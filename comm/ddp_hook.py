"""DDP comm hook: DDP's gradient buckets go through memrt's topology-aware all-reduce.

``model.register_comm_hook(None, memrt.comm.ddp_comm_hook)`` or
``memrt.comm.register_ddp_hook(model, compress=None)``. The bucket is scaled by ``1 / world_size``
exactly as DDP's built-in reducer does (a multiplication, not a division, so the values are bitwise
the same as without a hook), then summed with :func:`memrt.comm.all_reduce`'s algorithm choice
(hierarchical on multi-node jobs). ``compress`` ("bf16", "fp16", "int8", or "auto": bf16 where the cost
model predicts a gain of at least 10%) compresses the inter-node hop only; ``None`` follows
``MEMRT_COMPRESS``, ``"none"`` is exact.

Error feedback belongs to one bucket: its residual is keyed by the hook's registration and the bucket
index, and is dropped when the bucket's parameters change (DDP rebuilds its buckets after the first
step), so a residual is only ever added to the next reduction of the same gradients.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as tdist

if TYPE_CHECKING:
    from memrt.config import MemrtConfig

__all__ = ["DDPHookState", "ddp_comm_hook", "register_ddp_hook"]

_registrations = itertools.count()


@dataclass(kw_only=True, slots=True)
class DDPHookState:
    """State handed to :func:`ddp_comm_hook` by :func:`register_ddp_hook`."""

    compress: str | None = None
    """Codec of the inter-node hop: None (MEMRT_COMPRESS), 'none', 'auto', 'bf16', 'fp16' or 'int8'."""
    process_group: Any = None
    """Group to reduce over; None is the default group (the only one memrt makes topology-aware)."""
    registration: int = field(default_factory=lambda: next(_registrations))
    """Tells apart the buckets of two models in one process (their error-feedback residuals)."""

    def __post_init__(self) -> None:
        from memrt.comm.compress import check_compress

        check_compress(self.compress, "compress")


def ddp_comm_hook(state: Any, bucket):  # no annotations: DDP rejects any but the exact GradBucket/Future
    """``(state, bucket) -> Future[Tensor]``: the averaged bucket, through memrt.comm.all_reduce."""
    from memrt.comm.api import all_reduce_with
    from memrt.comm.compress import FeedbackKey, get_error_feedback

    hook_state = state if isinstance(state, DDPHookState) else None
    group = hook_state.process_group if hook_state is not None else state
    codec = hook_state.compress if hook_state is not None else None
    tensor = bucket.buffer()
    if codec is None:  # the job's MEMRT_COMPRESS, as memrt.comm read it once at set-up
        from memrt.comm.api import settings

        codec = settings(tensor.device).compress
    tensor.mul_(1.0 / tdist.get_world_size(group))  # DDP's reducer: grad * (1 / world), same rounding
    key = None
    if codec != "none":
        params = tuple(id(p) for p in bucket.parameters())
        owner = ("ddp", hook_state.registration if hook_state is not None else id(group), bucket.index())
        get_error_feedback().claim(owner, params)  # another parameter layout: the old residuals are dropped
        key = FeedbackKey(owner=owner)
    work = all_reduce_with(tensor, tdist.ReduceOp.SUM, group, True, key=key, codec=codec)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_ddp_hook(ddp_model: Any, *, compress: str | None = None, config: MemrtConfig | None = None) -> Any:
    """Register :func:`ddp_comm_hook` on ``ddp_model`` (a DistributedDataParallel); returns the model.

    Collective (every rank, as DDP's construction): memrt.comm's topology and groups are set up and every
    communicator is warmed here, on the model's device, so the hook's first call creates none mid-backward.
    ``config``: the settings memrt.comm sets up with, when it is not set up yet (default: the environment's)."""
    from memrt.comm.compress import check_compress

    check_compress(compress, "compress")  # before any collective: a bad value fails on every rank alike
    group = ddp_model.process_group
    if group is None or group is tdist.GroupMember.WORLD or group is tdist.distributed_c10d._get_default_group():
        from memrt.comm.api import prepare

        param = next(iter(ddp_model.parameters()), None)
        prepare(param.device if param is not None else None, config=config)  # groups made and warmed now, not mid-backward
    ddp_model.register_comm_hook(DDPHookState(compress=compress, process_group=group), ddp_comm_hook)
    return ddp_model
