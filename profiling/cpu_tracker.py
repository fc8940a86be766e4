"""Live tensor bytes on the CPU: peak and timeline (PyTorch keeps no allocator statistics for the CPU).

How it counts: while active, a ``TorchDispatchMode`` sees the output of every operator; each CPU storage
it has not seen yet is added (its ``nbytes``) and gets a weak reference whose callback subtracts it when
the storage dies. Storages that already exist when tracking starts (parameters, gradients, optimizer
state, inputs) are found by scanning the garbage collector's objects (plus ``.grad`` of every tensor)
and any tensors passed in ``extra``. Views and in-place results share a storage and count once.

What it cannot see: scratch memory a kernel allocates and frees internally without returning it as a
tensor, allocator/heap overhead, and of code ``torch.compile`` made (which runs compiled under the tracker,
an infrastructure mode to dynamo) the buffers inductor allocates without the dispatcher.
``tests/test_memory_tracker.py`` checks the peak against the process's peak RSS (glibc with
``MALLOC_MMAP_THRESHOLD_=65536``, so large blocks go back to the OS on free) and requires agreement within 10%.

"Ghosts" serve the memory planner: a storage marked with :meth:`CpuMemoryTracker.ghost` keeps being
counted in :attr:`CpuMemoryTracker.ghost_peak_bytes` after it dies, until :meth:`clear_ghosts`; this
measures what a unit's forward would hold if its saved tensors were kept, while they are in fact freed.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = ["CpuMemoryTracker", "MemoryMark", "dispatch_overhead_seconds", "storage_key", "tensor_storage_bytes"]


@dataclass(slots=True)
class MemoryMark:
    """A point of the tracker's timeline."""

    t_s: float
    """Seconds since :meth:`CpuMemoryTracker.start`."""
    live_bytes: int
    """Live tensor bytes at the mark."""
    segment_peak_bytes: int
    """Highest live bytes since the previous mark."""
    kind: str
    label: str


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(identity of the storage, its bytes) for a dense CPU tensor, else None."""
    try:
        if t.device.type != "cpu" or t.is_meta:
            return None
        s = t.untyped_storage()
        return s._cdata, s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensor_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (any device), skipping storage ids in ``exclude``."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        k = s._cdata
        if k in seen or (exclude is not None and k in exclude):
            continue
        seen.add(k)
        total += s.nbytes()
    return total


def _is_tensor(obj: Any) -> bool:
    """``isinstance(obj, torch.Tensor)``; False for a weak proxy whose object is gone (dynamo keeps some among
    the garbage collector's objects, and ``isinstance`` of a dead proxy raises)."""
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:
        return False


class _StorageRef(weakref.ref):
    """A weak reference to a storage that knows the storage's key (cheaper than weakref.finalize)."""

    __slots__ = ("key",)

    def __new__(cls, obj: Any, callback: Any, key: int) -> "_StorageRef":
        return super().__new__(cls, obj, callback)

    def __init__(self, obj: Any, callback: Any, key: int) -> None:
        super().__init__(obj, callback)
        self.key = key


class _Mode(TorchDispatchMode):
    """Sees every operator's output. An infrastructure mode to dynamo: code torch.compile made runs compiled
    under it, as without it (dynamo runs a frame under a user's mode eagerly, which computes other bits, and
    the frame then stays eager). Of compiled code it sees what the generated wrapper allocates through the
    dispatcher and the tensors the graph returns, not the buffers inductor allocates directly."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self, tracker: "CpuMemoryTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tr = self.tracker
        tr.ops += 1
        if type(out) is torch.Tensor:
            tr._add(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    tr._add(t)
                elif isinstance(t, (tuple, list)):
                    tr.track(t)
        elif isinstance(out, torch.Tensor):
            tr._add(out)
        return out


class CpuMemoryTracker:
    """Peak and timeline of live CPU tensor bytes while active (a context manager, or start()/stop()).

    ``record=True`` also sends every :meth:`mark` to :func:`memrt.profiling.recorder.get_recorder`
    (memory timeline of ``memrt report``).
    """

    def __init__(self, *, record: bool = False) -> None:
        self.record = record
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, _StorageRef] = {}
        self._on_dead = self._dead_ref  # one bound method for every reference
        self._ghosts: set[int] = set()
        self._dead_ghost_bytes = 0
        self._lock = threading.RLock()
        self._mode: _Mode | None = None
        self._t0 = 0.0
        self.live_bytes = 0
        """Live tracked bytes now."""
        self.peak_bytes = 0
        """Highest live bytes since start (or :meth:`reset_peak`)."""
        self.segment_peak_bytes = 0
        """Highest live bytes since the last :meth:`mark` / :meth:`segment`."""
        self.ghost_peak_bytes = 0
        """Highest live + dead-ghost bytes since the last :meth:`segment`."""
        self.start_bytes = 0
        """Live bytes found when tracking started."""
        self.timeline: list[MemoryMark] = []
        self.ops = 0
        """Operators seen while active."""

    # -- counting -------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        if not t.is_cpu:
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        if s.device.type != "cpu":  # a fake tensor of a graph dynamo traces under the tracker: no memory
            return
        k = s._cdata
        n = s.nbytes()
        old = self._sizes.get(k)
        if old == n:
            return
        with self._lock:
            old = self._sizes.get(k)
            if old is None:
                self._sizes[k] = n
                self.live_bytes += n
                self._refs[k] = _StorageRef(s, self._on_dead, k)
            elif old != n:  # resized in place
                self._sizes[k] = n
                self.live_bytes += n - old
            else:
                return
            self._bump()

    def _bump(self) -> None:
        live = self.live_bytes
        if live > self.peak_bytes:
            self.peak_bytes = live
        if live > self.segment_peak_bytes:
            self.segment_peak_bytes = live
        g = live + self._dead_ghost_bytes
        if g > self.ghost_peak_bytes:
            self.ghost_peak_bytes = g

    def _dead_ref(self, ref: "_StorageRef") -> None:
        if self._refs.get(ref.key) is ref:  # not a reference replaced after stop() and a restart
            self._dead(ref.key)

    def _dead(self, k: int) -> None:
        with self._lock:
            n = self._sizes.pop(k, 0)
            self._refs.pop(k, None)
            self.live_bytes -= n
            if k in self._ghosts:
                self._ghosts.discard(k)
                self._dead_ghost_bytes += n

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors' storages (if not yet counted)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    # -- ghosts (see module docstring) -----------------------------------------------------------
    def ghost(self, t: torch.Tensor) -> None:
        """Keep counting ``t``'s storage in ``ghost_peak_bytes`` after it dies, until :meth:`clear_ghosts`."""
        key = storage_key(t)
        if key is None:
            return
        self._add(t)
        with self._lock:
            self._ghosts.add(key[0])

    def clear_ghosts(self) -> None:
        with self._lock:
            self._ghosts.clear()
            self._dead_ghost_bytes = 0
            self.ghost_peak_bytes = self.live_bytes

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, extra: Iterable[Any] = (), *, scan_gc: bool = True) -> "CpuMemoryTracker":
        """Count existing CPU tensors (gc scan + ``extra``) and start watching operators."""
        if self._mode is not None:
            raise RuntimeError("CpuMemoryTracker.start() called twice without stop()")
        self._t0 = time.perf_counter()
        if scan_gc:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                objs = [o for o in gc.get_objects() if _is_tensor(o)]
            for obj in objs:
                self._add(obj)
                g = obj.grad if obj.requires_grad and obj.is_leaf else None
                if g is not None:
                    self._add(g)
        self.track(extra)
        self.start_bytes = self.live_bytes
        self.peak_bytes = self.segment_peak_bytes = self.ghost_peak_bytes = self.live_bytes
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def pause(self) -> None:
        """Stop counting new tensors; tensors already counted still leave ``live_bytes`` when freed
        (until :meth:`stop`). Peaks stay as they are."""
        self._pop_mode()

    def stop(self) -> None:
        """Stop watching operators and frees (counts stay readable). Safe to call twice."""
        self._pop_mode()
        self._refs.clear()  # dropped references never call back
        self._sizes.clear()
        self._ghosts.clear()

    def _pop_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if _get_current_dispatch_mode() is mode:
            mode.__exit__(None, None, None)
        else:  # another mode was pushed above ours and not popped: leave the stack alone
            import logging

            logging.getLogger(__name__).warning("CPU memory tracker: dispatch mode stack changed; tracker left inactive")
            mode.tracker = _NullTracker()  # type: ignore[assignment]

    @property
    def active(self) -> bool:
        return self._mode is not None

    def __enter__(self) -> "CpuMemoryTracker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- readings ---------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        self.peak_bytes = self.segment_peak_bytes = self.live_bytes
        self.ghost_peak_bytes = self.live_bytes + self._dead_ghost_bytes

    def segment(self) -> tuple[int, int]:
        """(peak, ghost peak) since the previous segment()/mark(); starts a new segment."""
        out = (self.segment_peak_bytes, self.ghost_peak_bytes)
        self.segment_peak_bytes = self.live_bytes
        self.ghost_peak_bytes = self.live_bytes + self._dead_ghost_bytes
        return out

    def mark(self, kind: str, label: str = "") -> MemoryMark:
        """Add a timeline point (and a recorder event when ``record``); starts a new segment."""
        peak, _ = self.segment()
        m = MemoryMark(time.perf_counter() - self._t0, self.live_bytes, peak, kind, label)
        self.timeline.append(m)
        if self.record:
            from memrt.profiling.recorder import get_recorder

            rec = get_recorder()
            if peak > m.live_bytes:
                rec.record_memory(peak, "peak", label)
            rec.record_memory(m.live_bytes, kind, label)
        return m


_OVERHEAD: list[float] = []


def dispatch_overhead_seconds() -> float:
    """Seconds the tracker adds per operator (measured once per process on tiny ops)."""
    if not _OVERHEAD:
        a, b = torch.ones(4), torch.ones(4)
        n = 400

        def loop() -> float:
            t = time.perf_counter()
            for _ in range(n):
                torch.add(a, b)
            return time.perf_counter() - t

        base = min(loop() for _ in range(3))
        tr = CpuMemoryTracker()
        tr.start(scan_gc=False)
        try:
            with_mode = min(loop() for _ in range(3))
        finally:
            tr.stop()
        _OVERHEAD.append(max(0.0, (with_mode - base) / n))
    return _OVERHEAD[0]


class _NullTracker:
    ops = 0


    def _add(self, t: torch.Tensor) -> None:
        pass
