"""memrt.comm: topology-aware drop-in torch.distributed.

``import memrt.comm as dist`` gives torch.distributed's names and signatures. memrt's own versions
(init_process_group, all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
destroy_process_group) know the cluster's shape; every other name is torch.distributed's, unchanged.
``dist.get_topology()`` describes the cluster; ``dist.register_ddp_hook(model)`` routes DDP's gradients.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from memrt.comm.api import (MemrtWork, all_gather, all_gather_into_tensor, all_gather_single, all_reduce, broadcast,
                            comm_mode, destroy_process_group, get_topology, init_process_group, prepare,
                            reduce_scatter_single, reduce_scatter_tensor, set_checks, settings, setup_topology)
from memrt.comm.ddp_hook import DDPHookState, ddp_comm_hook, register_ddp_hook
from memrt.comm.explain import explain  # per (op, size) table of choices and timings
from memrt.comm.fusion import all_reduce_coalesced  # fusion of many small tensors
from memrt.comm.health import CollectiveMismatchError, PeerFailureError
from memrt.comm.topology import Topology

__all__ = [
    "CollectiveMismatchError", "DDPHookState", "MemrtWork", "PeerFailureError", "Topology",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_reduce_coalesced", "broadcast",
    "comm_mode", "ddp_comm_hook", "explain",
    "destroy_process_group", "get_topology", "init_process_group", "prepare", "reduce_scatter_single",
    "reduce_scatter_tensor", "register_ddp_hook", "set_checks", "settings", "setup_topology",
]

_HERE = Path(__file__).parent


def __getattr__(name: str) -> Any:
    """Submodules of memrt.comm first, then torch.distributed's names and subpackages (pass-through)."""
    if (_HERE / f"{name}.py").exists():
        return importlib.import_module(f"{__name__}.{name}")
    import torch.distributed

    try:
        return getattr(torch.distributed, name)
    except AttributeError:
        pass
    try:  # a subpackage torch.distributed does not import itself (fsdp, checkpoint, ...)
        return importlib.import_module(f"torch.distributed.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"torch.distributed.{name}":  # the subpackage exists and failed to import: say so
            raise
        raise AttributeError(f"module 'memrt.comm' has no attribute {name!r} (nor has torch.distributed)") from None


def __dir__() -> list[str]:
    import torch.distributed

    return sorted(set(__all__) | set(dir(torch.distributed)))
