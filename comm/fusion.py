"""Fusion of many small all-reduces into few large ones.

- :func:`all_reduce_coalesced` (like ``torch.distributed.all_reduce_coalesced``): a list of tensors
  is packed per (dtype, device) into flat buffers of at most ``bucket_bytes``, each buffer is reduced
  with one :func:`memrt.comm.all_reduce` call (so it gets the per-call algorithm choice) and the
  results are copied back.
- Automatic coalescing: back-to-back ``memrt.comm.all_reduce(t, async_op=True)`` calls on tensors of
  at most ``max_tensor_bytes`` are deferred and packed together; the pack goes out when it reaches
  ``bucket_bytes``, when any deferred call's ``wait()`` runs, or when a call that is not deferred
  (synchronous, large, other group) arrives, which keeps every rank's collective order identical.

In torch.profiler each user call shows as one event of the backend's name (``gloo:all_reduce``) with
the user's tensors, as stock gives; the fused buffers' own collectives are not recorded there.

Reduction results are exactly those of separate calls on each rank's values: fusion concatenates,
it does not change what is summed (the fused call's algorithm may sum in another order, as any
algorithm change may; MEMRT_COMM=flat keeps torch's).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from memrt.comm import events

__all__ = ["all_reduce_coalesced", "FusedWork", "set_auto_coalescing", "intercept", "flush", "AutoCoalescing"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 16 * 1024 * 1024
"""Largest fused buffer, bytes."""


_reduce: list[Callable[..., Any]] = []
"""memrt.comm's all-reduce of one buffer (``(buf, op, group, async_op, *, key)``), handed over by
:mod:`memrt.comm.api` when it is imported: fusion sits below the API it feeds."""


def use_all_reduce(fn: Callable[..., Any]) -> None:
    """The all-reduce every fused buffer goes through (memrt.comm.api registers its own)."""
    _reduce[:] = [fn]


def _all_reduce(buf: torch.Tensor, op: Any, group: Any, async_op: bool):
    return _reduce[0](buf, op, group, async_op, key=("fused", buf.numel(), str(buf.dtype)))


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped per (dtype, device) in call order, each group split at bucket_bytes."""
    out: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        k = (t.dtype, t.device)
        idx, size = open_.get(k, ([], 0))
        nb = t.numel() * t.element_size()
        if idx and size + nb > bucket_bytes:
            out.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_[k] = (idx, size + nb)
    out.extend(idx for idx, _ in open_.values() if idx)
    return out


class FusedWork:
    """Waitable for tensors reduced as part of a fused buffer: ``wait()`` copies their slices back."""

    def __init__(self, pack: "_Pack", index: int | None = None) -> None:
        self._pack, self._index = pack, index

    def wait(self, timeout: Any = None) -> bool:
        self._pack.complete()
        return True

    def is_completed(self) -> bool:
        """Non-blocking; a deferred pack is sent now, so polling callers make progress."""
        pack = self._pack
        if pack.done:
            return True
        pack.ensure_launched()
        if all(w is None or not hasattr(w, "is_completed") or w.is_completed() for w, _, _ in pack.works):
            pack.complete()
            return True
        return False

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.wait()
        fut.set_result(self._pack.tensors if self._index is None else [self._pack.tensors[self._index]])
        return fut

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._pack.tensors if self._index is None else [self._pack.tensors[self._index]]


class _Pack:
    """Tensors sharing one flat buffer per bucket; launched once, completed once."""

    def __init__(self, tensors: list[torch.Tensor], op: Any, group: Any, bucket_bytes: int,
                 on_launch: Any = None) -> None:
        self.tensors, self.op, self.group, self.bucket_bytes = tensors, op, group, bucket_bytes
        self.works: list[tuple[Any, torch.Tensor, list[int]]] = []
        self.launched = self.done = False
        self._lock = threading.Lock()
        self._on_launch = on_launch
        self.events: list[events.UserEvent | None] = []
        """Profiler events of the user calls in this pack, closed when it completes."""

    def launch(self) -> None:
        with self._lock:
            if self.launched:
                return
            self.launched = True
        if self._on_launch is not None:
            self._on_launch(self)
        with events.quiet():  # the user's calls carry the profiler events, not the fused buffers
            for idx in _buckets(self.tensors, self.bucket_bytes):
                ts = [self.tensors[i] for i in idx]
                buf = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()
                work = _all_reduce(buf, self.op, self.group, True)
                self.works.append((work, buf, idx))

    def ensure_launched(self) -> None:
        if not self.launched:
            _auto.flush_until(self)
            self.launch()

    def complete(self) -> None:
        if self.done:
            return
        self.ensure_launched()
        with events.quiet():
            for work, buf, idx in self.works:
                if work is not None:
                    work.wait()
                off = 0
                for i in idx:
                    t = self.tensors[i]
                    t.copy_(buf[off:off + t.numel()].view(t.shape))
                    off += t.numel()
        self.done = True
        events.end_all(self.events)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = None, group: Any = None, async_op: bool = False,
                         *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> FusedWork | None:
    """All-reduce every tensor of ``tensors`` in place with as few collective calls as possible."""
    import torch.distributed as dist

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} is not valid: expected a positive number of bytes")
    op = dist.ReduceOp.SUM if op is None else op
    tensors = list(tensors)
    if not tensors:
        return None
    flush()  # earlier deferred calls go first, on every rank
    pack = _Pack(tensors, op, group, bucket_bytes)
    pack.events.append(events.begin("all_reduce_coalesced", tensors))
    try:
        pack.launch()
    except BaseException:  # bad input (e.g. MAX of complex tensors): raised here, as torch raises
        events.end_all(pack.events)
        raise
    work = FusedWork(pack)
    if async_op:
        return work
    work.wait()
    return None


@dataclass(kw_only=True, slots=True)
class AutoCoalescing:
    """Settings of automatic coalescing of back-to-back async all-reduces."""

    enabled: bool = True
    """Defer small async all-reduces on the default group and fuse them."""
    max_tensor_bytes: int = 256 * 1024
    """Only tensors of at most this many bytes are deferred; larger ones go out at once."""
    bucket_bytes: int = 4 * 1024 * 1024
    """A pending pack is sent when it reaches this many bytes."""


class _Auto:
    def __init__(self) -> None:
        self.settings = AutoCoalescing()
        self.pending: list[tuple[torch.Tensor, Any]] = []
        self.pending_bytes = 0
        self.key: tuple | None = None
        self.packs: list[_Pack] = []
        self._lock = threading.RLock()

    def defer(self, tensor: torch.Tensor, op: Any) -> FusedWork:
        with self._lock:
            key = (str(op), tensor.dtype, tensor.device)
            if self.pending and key != self.key:
                self._launch_pending()
            if not self.pending:
                self.packs.append(_Pack([], op, None, self.settings.bucket_bytes, on_launch=self._forget))
            self.key = key
            pack = self.packs[-1]
            pack.tensors.append(tensor)
            pack.events.append(events.begin("all_reduce", [tensor]))
            self.pending.append((tensor, op))
            self.pending_bytes += tensor.numel() * tensor.element_size()
            work = FusedWork(pack, len(pack.tensors) - 1)
            if self.pending_bytes >= self.settings.bucket_bytes:
                self._launch_pending()
            return work

    def _forget(self, pack: _Pack) -> None:
        with self._lock:
            if self.packs and self.packs[-1] is pack and self.pending:
                self.pending, self.pending_bytes, self.key = [], 0, None

    def _launch_pending(self) -> None:
        if self.pending:
            pack = self.packs[-1]
            self.pending, self.pending_bytes, self.key = [], 0, None
            pack.launch()

    def flush_until(self, pack: _Pack) -> None:
        """Launch pending packs in call order (every rank does the same) up to ``pack``."""
        with self._lock:
            for p in list(self.packs):
                if p is pack:
                    break
                p.launch()
            self.packs = [p for p in self.packs if not p.launched]

    def flush(self) -> None:
        with self._lock:
            self._launch_pending()
            self.packs = [p for p in self.packs if not p.launched]


_auto = _Auto()


def set_auto_coalescing(enabled: bool = True, *, max_tensor_bytes: int | None = None,
                        bucket_bytes: int | None = None) -> AutoCoalescing:
    """Change automatic coalescing (collective in effect: set the same on every rank); returns the settings."""
    flush()
    s = _auto.settings
    s.enabled = bool(enabled)
    if max_tensor_bytes is not None:
        s.max_tensor_bytes = int(max_tensor_bytes)
    if bucket_bytes is not None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} is not valid: expected a positive number of bytes")
        s.bucket_bytes = int(bucket_bytes)
    return s


def intercept(tensor: torch.Tensor, op: Any, async_op: bool) -> FusedWork | None:
    """Called by memrt.comm.all_reduce for the default group: defer a small async call (returns its
    work), else flush what is pending (so order is kept) and return None for the caller to proceed."""
    s = _auto.settings
    if s.enabled and async_op and tensor.numel() * tensor.element_size() <= s.max_tensor_bytes and \
            tensor.is_contiguous() and (tensor.is_floating_point() or "AVG" not in str(op).upper()):
        return _auto.defer(tensor, op)  # (integer AVG is not deferred: its error is raised at the call)
    flush()
    return None


def flush() -> None:
    """Send every deferred all-reduce now (call on every rank, as memrt.comm does before other calls)."""
    if _auto.pending:
        _auto.flush()
