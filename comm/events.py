"""torch.profiler events of memrt.comm's collectives: one per user call, as the backend itself records.

A stock gloo/nccl call shows in torch.profiler as one asynchronous event named after the backend
(``gloo:all_reduce``, ``gloo:broadcast``, ...) whose inputs are the user's tensors (their shapes with
``record_shapes=True``). When memrt runs a call its own way (hierarchical, fused with other calls, on
the MPI backend) the backend would instead see memrt's internal calls (shards, flat buffers, sub-group
collectives). So memrt records the user's call itself and hides its internal calls:

- :func:`begin` opens the event on the calling thread with the user's tensors as inputs;
  :meth:`UserEvent.end` closes it on another thread (memrt's comm thread when the work ran there),
  so the profiler marks it asynchronous like the backend's own events.
- :func:`quiet` turns RecordFunction off on this thread around memrt's internal calls.

Nothing here runs unless a profiler is on (one cheap check per call).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch

__all__ = ["UserEvent", "begin", "quiet", "profiling", "event_name", "end_all"]

_tls = threading.local()

_STOCK_TITLE = {("gloo", "reduce_scatter"): "all_reduce", ("gloo", "all_reduce_coalesced"): "all_reduce"}
"""Where a backend's own event name is not the op's: gloo runs reduce_scatter_tensor as an all-reduce and
records all_reduce_coalesced as ``gloo:all_reduce`` (torch 2.x)."""


def profiling() -> bool:
    """True when a torch profiler is recording on this thread."""
    return torch._C._autograd._profiler_enabled()


def event_name(op: str, backend: str | None = None) -> str:
    """``"<backend>:<op>"`` as the backend's own event for ``op`` is named (e.g. ``gloo:all_reduce``)."""
    if backend is None:
        import torch.distributed as tdist

        backend = str(tdist.get_backend()) if tdist.is_initialized() else "memrt"
    return f"{backend}:{_STOCK_TITLE.get((backend, op), op)}"


class UserEvent:
    """An open profiler event for one user-level call; :meth:`end` closes it (once)."""

    __slots__ = ("_fut", "_ended", "_lock")

    def __init__(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        handle = torch._C._autograd._record_function_with_args_enter(name, *tensors)
        # Ended through a torch Future: its callback runs with this thread's profiler state on the
        # thread that completes the future, so the event is recorded and marked asynchronous.
        self._fut: torch.futures.Future = torch.futures.Future()
        torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, self._fut)
        self._ended = False
        self._lock = threading.Lock()

    def end(self, *, here: bool = False) -> None:
        """Close the event; ``here=True`` when the caller already is a thread other than the opener's."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        if here:
            self._fut.set_result(None)
            return
        t = threading.Thread(target=self._fut.set_result, args=(None,), name="memrt-profiler-event")
        t.start()
        t.join()


def begin(op: str, tensors: Sequence[torch.Tensor]) -> UserEvent | None:
    """The event of one user call of ``op`` on ``tensors``; None when no profiler is on or when this is
    one of memrt's internal calls (inside :func:`quiet`)."""
    if getattr(_tls, "depth", 0) or not profiling():
        return None
    # complex tensors as their real views: what the backends hand to the profiler
    return UserEvent(event_name(op), [torch.view_as_real(t) if t.is_complex() else t
                                      for t in tensors if isinstance(t, torch.Tensor)])


@contextlib.contextmanager
def quiet(active: bool = True) -> Iterator[None]:
    """RecordFunction off on this thread inside the block (memrt's internal calls), when ``active``
    and a profiler is on; restored after."""
    if not active or not profiling():
        yield
        return
    _tls.depth = getattr(_tls, "depth", 0) + 1
    torch._C._autograd._enable_record_function(False)
    try:
        yield
    finally:
        _tls.depth -= 1
        if not _tls.depth:
            torch._C._autograd._enable_record_function(True)


def end_all(events: Sequence[Any]) -> None:
    """Close every open event of ``events`` (None entries skipped)."""
    for ev in events:
        if ev is not None:
            ev.end()
