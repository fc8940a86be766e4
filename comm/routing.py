"""Which path a collective issued on this thread takes: memrt's own, or straight to the real backend.

memrt's algorithms run their sub-collectives on real gloo / NCCL groups, and the ``memrt`` process group
(:mod:`memrt.comm.backend`) must not route those back into memrt. Two per-thread markers say so:
:func:`internal_groups` (groups created inside are plain real groups) and :func:`passthrough` (calls made
inside go to the real backend as they are). Both the collectives (:mod:`memrt.comm.api`) and the process
group read them, so they live here, below both.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["busy", "inside_internal_groups", "internal_groups", "passthrough", "real_backend_name"]

_local = threading.local()


@contextlib.contextmanager
def _marked(marker: str) -> Iterator[None]:
    depth = getattr(_local, marker, 0)
    setattr(_local, marker, depth + 1)
    try:
        yield
    finally:
        setattr(_local, marker, depth)


def internal_groups() -> contextlib.AbstractContextManager[None]:
    """Groups created inside (by memrt itself) are plain gloo / NCCL groups, never memrt groups."""
    return _marked("internal")


def passthrough() -> contextlib.AbstractContextManager[None]:
    """Collectives issued on this thread inside go straight to the real backends (memrt is already in)."""
    return _marked("busy")


def busy() -> bool:
    """Whether this thread is inside :func:`passthrough`."""
    return getattr(_local, "busy", 0) > 0


def inside_internal_groups() -> bool:
    """Whether this thread is inside :func:`internal_groups`."""
    return getattr(_local, "internal", 0) > 0


def real_backend_name(device_type: str = "cpu") -> str:
    """The backend that runs the default group's collectives on ``device_type`` tensors: torch's backend name,
    or under memrt's process group the real backend it owns for that device ("gloo", "nccl")."""
    import torch.distributed as dist

    inner = getattr(dist.distributed_c10d._get_default_group(), "inner_backends", None)
    if callable(inner):
        backends = inner()
        return backends.get(device_type, backends.get("cpu", ""))
    return str(dist.get_backend())
