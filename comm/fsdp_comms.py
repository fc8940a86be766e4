"""FSDP2's all-gather and reduce-scatter through memrt.comm, without memrt's process group.

``memrt.comm.fsdp_comms.use_memrt_comms(model)`` hands every ``fully_shard`` module of ``model`` memrt's
:class:`MemrtAllGather` and :class:`MemrtReduceScatter` through FSDP2's public
``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Use it when the job keeps torch's own
backend (``MEMRT_COMM=off`` for the activation, an NCCL group split from a bound device): FSDP2's
collectives then still run memrt's topology-aware algorithms and appear in the comm log. With memrt's
process group (:mod:`memrt.comm.backend`, what ``MEMRT=1`` sets up) this is not needed: FSDP2's default
collectives already reach memrt.

Only FSDP2's own collectives change; DDP, DeviceMesh groups and plain calls need the process group.
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

        return api.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class MemrtReduceScatter(_ReduceScatter):
    """FSDP2 reduce-scatter as :func:`memrt.comm.reduce_scatter_tensor`; ops memrt lacks (PREMUL_SUM) go to torch."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        from memrt.comm import api

        name = str(getattr(op, "op", op)).split(".")[-1].upper()
        if name not in REDUCE_OPS:
            return tdist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
        return api.reduce_scatter_tensor(output_tensor, input_tensor, getattr(op, "op", op), group=group,
                                         async_op=async_op)


def use_memrt_comms(model: torch.nn.Module) -> int:
    """Give every FSDP2 module in ``model`` memrt's all-gather and reduce-scatter; returns how many."""
    from torch.distributed.fsdp import FSDPModule

    gather, scatter = MemrtAllGather(), MemrtReduceScatter()
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
            count += 1
    if count == 0:
        raise ValueError("use_memrt_comms: the model holds no fully_shard (FSDP2) module: call fully_shard first")
    return count
