"""FSDP2's all-gather and reduce-scatter through memrt.comm: without memrt's process group, and compressed.

``memrt.comm.fsdp_comms.use_memrt_comms(model)`` hands every ``fully_shard`` module of ``model`` memrt's
:class:`MemrtAllGather` and :class:`MemrtReduceScatter` through FSDP2's public
``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Use it when the job keeps torch's own
backend (``MEMRT_COMM=off`` for the activation, an NCCL group split from a bound device): FSDP2's
collectives then still run memrt's topology-aware algorithms and appear in the comm log. With memrt's
process group (:mod:`memrt.comm.backend`, what ``MEMRT=1`` sets up) this is not needed: FSDP2's default
collectives already reach memrt.

Only FSDP2's own collectives change; DDP, DeviceMesh groups and plain calls need the process group.

Gradient compression (``MEMRT_COMPRESS``, ``use_memrt_comms(model, compress=...)``) always takes this
path: a process-group call does not say which gradients it reduces, while each module's own
:class:`MemrtReduceScatter` does, so error feedback stays with its parameter group (as the DDP hook keeps
it with its bucket) and a plain ``reduce_scatter_tensor`` of user code is never compressed.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as tdist

from memrt.comm.reduction import REDUCE_OPS

__all__ = ["MemrtAllGather", "MemrtReduceScatter", "use_memrt_comms"]



def _comm_classes() -> tuple[type, type]:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


_AllGather, _ReduceScatter = _comm_classes()


class MemrtAllGather(_AllGather):
    """FSDP2 all-gather as :func:`memrt.comm.all_gather_into_tensor` (same output layout)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        from memrt.comm import api

        if _spans_world(group):
            group = None
        return api.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class MemrtReduceScatter(_ReduceScatter):
    """FSDP2 reduce-scatter as :func:`memrt.comm.reduce_scatter_tensor`; ops memrt lacks (PREMUL_SUM) go to torch.

    ``compress`` ("bf16", "fp16", "int8", "auto"; None: exact) compresses the inter-node hop of the gradient
    reduce-scatter. ``owner`` names the gradient buffer for error feedback: give each ``fully_shard`` module
    an instance of its own (:func:`use_memrt_comms` does), so a residual only ever returns to the parameter
    group it was taken from.
    """

    def __init__(self, compress: str | None = None, owner: Any = None) -> None:
        if compress is not None:
            from memrt.comm.compress import check_compress

            check_compress(compress, "compress")
        self.compress = None if compress in (None, "none") else compress
        self.owner = owner

    @classmethod
    def for_module(cls, module: torch.nn.Module, compress: str | None = None) -> "MemrtReduceScatter":
        """The reduce-scatter of one ``fully_shard`` module: its residuals are its own."""
        return cls(compress, owner=("fsdp2", id(module)))

    def _key(self, input_tensor: torch.Tensor) -> Any:
        if self.compress is None or self.owner is None:
            return None
        from memrt.comm.compress import FeedbackKey, get_error_feedback

        # FSDP2 allocates the input afresh each step, laid out the same while the module's parameters are
        get_error_feedback().claim(self.owner, (input_tensor.numel(), input_tensor.dtype))
        return FeedbackKey(owner=self.owner)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        from memrt.comm import api

        name = str(getattr(op, "op", op)).split(".")[-1].upper()
        if name not in REDUCE_OPS:
            return tdist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
        if _spans_world(group):  # another handle on every rank in rank order (a 1-D mesh's group): the world
            group = None
        return api.reduce_scatter_tensor(output_tensor, input_tensor, getattr(op, "op", op), group=group,
                                         async_op=async_op, compress=self.compress, key=self._key(input_tensor))


def _spans_world(group: Any) -> bool:
    """``group`` has every rank in rank order on the default group's backend: memrt's world algorithms apply."""
    return (group is not None and tdist.is_initialized()
            and tdist.get_process_group_ranks(group) == list(range(tdist.get_world_size()))
            and tdist.get_backend(group) == tdist.get_backend())


def use_memrt_comms(model: torch.nn.Module, *, compress: str | None = None, all_gather: bool = True) -> int:
    """Give every FSDP2 module in ``model`` memrt's reduce-scatter (and all-gather); returns how many.

    ``compress``: compression of the gradient reduce-scatter's inter-node hop (see
    :class:`MemrtReduceScatter`), each module keeping its own error-feedback residuals.
    ``all_gather=False`` leaves the all-gather as it is (under memrt's process group it already runs
    memrt's algorithms)."""
    from torch.distributed.fsdp import FSDPModule

    gather = MemrtAllGather()
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if all_gather:
                module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(MemrtReduceScatter.for_module(module, compress))
            count += 1
    if count == 0:
        raise ValueError("use_memrt_comms: the model holds no fully_shard (FSDP2) module: call fully_shard first")
    return count
