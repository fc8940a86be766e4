"""Seconds each thread has spent waiting on collectives issued through memrt's process group.

A job's own blocking collectives (a loss all-reduced for logging, a barrier, SyncBatchNorm's statistics in
forward) wait for the slowest rank. Whoever times a rank's work (:mod:`memrt.balance.auto`) reads
:func:`waited_seconds` before and after and leaves that wait out. Only the outermost wait of a thread counts
(a Work waiting on the Works inside it is one wait).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

__all__ = ["waited_seconds", "waiting"]

_local = threading.local()


def waited_seconds() -> float:
    """Total seconds the calling thread has spent inside :func:`waiting` (monotonic per thread)."""
    return getattr(_local, "seconds", 0.0)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Count the time inside as this thread's wait on a collective (nested waits count once)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.seconds = waited_seconds() + time.perf_counter() - start
