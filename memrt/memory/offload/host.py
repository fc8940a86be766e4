"""Host tier (CUDA): saved activations copied to a pre-sized, reused pinned-memory pool on side streams.

- :class:`HostPool` hands out byte ranges of a few large pinned buffers (first fit, coalescing free
  list). It is sized once, from the plan (:func:`pool_bytes_for`: the bytes moved per step plus the
  alignment slack), before the first offloaded forward, and reused every step. When a step needs more it
  grows by one buffer (``stats().pinned_allocations`` counts them) and keeps every buffer it has: it never
  re-allocates a merged buffer while the old ones sit in torch's pinned-memory cache (that would hold
  the pool twice). A range freed with an event (the last copy touching it) is handed out again without
  a host synchronisation: the next user gets the event and makes its copy stream wait for it (GPU side).
- :class:`HostTier` copies device -> host on one stream and host -> device on another (the two
  directions overlap on the two copy engines). A store waits for the producing stream, copies, and
  keeps the source alive in its unit's batch; when the next unit's forward ends the compute stream waits
  (GPU side) for those copies and the sources are dropped, so their blocks go back to the compute
  stream's pool in stream order: no ``record_stream``, no deferred frees, and at most two units of
  sources in flight (back-pressure instead of reserved memory growing when copies lag compute).
  A load allocates its destination on the consumer (compute) stream, so restored activations come from
  the same pool as the ones the plan counts, and the consumer waits on the load's event before use.
"""

from __future__ import annotations

import bisect
import logging
import threading

import torch

from memrt.memory.offload.errors import OffloadError

__all__ = ["HostPool", "HostTier", "pool_bytes_for"]

logger = logging.getLogger(__name__)

_ALIGN = 512
_SLACK_BYTES = 4 * 1024 * 1024


def pool_bytes_for(required_bytes: int) -> int:
    """Pinned pool size for a plan moving ``required_bytes`` per step: + 1/64 and 4 MiB for 512-byte alignment
    of every range (tensors of >= 64 KiB waste < 1/128 each) and a few odd-sized tensors."""
    required_bytes = int(required_bytes)
    return 0 if required_bytes <= 0 else required_bytes + required_bytes // 64 + _SLACK_BYTES


class HostPool:
    """Sub-allocates large (pinned when ``pin``) uint8 buffers; ``free(block, event)`` defers reuse.

    ``alloc`` returns ``(chunk, offset, size, view)``; :attr:`last_waits` then holds the events of earlier
    copies the caller must wait for (on its copy stream) before writing the range (empty when none).
    """

    def __init__(self, capacity_bytes: int, *, pin: bool = True) -> None:
        self.pin = pin
        self._lock = threading.Lock()
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int, tuple]]] = []  # per chunk: sorted (offset, size, events to wait)
        self._pending: list[tuple[int, int, int, object]] = []  # (chunk, offset, size, event)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0  # pinned (or plain) buffer allocations ever made
        self.last_waits: tuple = ()
        if capacity_bytes > 0:
            self._grow(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def _grow(self, nbytes: int) -> None:
        nbytes = -(-int(nbytes) // _ALIGN) * _ALIGN
        try:
            chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as exc:
            raise OffloadError(f"cannot allocate {nbytes} bytes of pinned host memory for the host offload tier "
                               f"({exc}); lower the share offloaded to host (MEMRT_OFFLOAD=disk) or raise "
                               f"MEMRT_BUDGET") from exc
        self._chunks.append(chunk)
        self._free.append([(0, nbytes, ())])
        self.allocations += 1
        if self.allocations > 1:
            logger.info("host offload pool: grew by %d bytes to %d (pinned allocation %d); the plan's size was short",
                        nbytes, self.capacity_bytes, self.allocations)

    def alloc(self, nbytes: int) -> tuple[int, int, int, torch.Tensor]:
        """A block ``(chunk, offset, size, view)`` of at least ``nbytes`` (see :attr:`last_waits`)."""
        size = -(-max(1, int(nbytes)) // _ALIGN) * _ALIGN
        with self._lock:
            self._collect(take_all=False)
            found = self._find(size)
            if found is None and self._pending:  # short: take ranges still in use by queued copies, wait on GPU
                self._collect(take_all=True)
                found = self._find(size)
            if found is None:
                self._grow(max(size, self.capacity_bytes // 2))
                found = self._find(size)
            ci, off, waits = found
            self.last_waits = waits
            self.used_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return ci, off, size, self._chunks[ci][off:off + int(nbytes)]

    def free(self, block: tuple[int, int, int, torch.Tensor], event=None) -> None:
        """Return ``block``; its next user waits for ``event`` (a CUDA event of the last copy touching it)."""
        ci, off, size, _ = block
        with self._lock:
            self.used_bytes -= size
            if event is None:
                self._insert(ci, off, size, ())
            else:
                self._pending.append((ci, off, size, event))

    def _collect(self, *, take_all: bool) -> None:
        """Ranges whose copies are done go back to the free list; ``take_all``: the others too, with their
        events (never a host synchronisation: stream order on the next user's side protects them)."""
        keep = []
        for ci, off, size, ev in self._pending:
            if ev.query():
                self._insert(ci, off, size, ())
            elif take_all:
                self._insert(ci, off, size, (ev,))
            else:
                keep.append((ci, off, size, ev))
        self._pending = keep

    def _find(self, size: int) -> tuple[int, int, tuple] | None:
        for ci, free in enumerate(self._free):
            for i, (off, sz, waits) in enumerate(free):
                if sz >= size:
                    if sz == size:
                        free.pop(i)
                    else:
                        free[i] = (off + size, sz - size, waits)
                    return ci, off, waits
        return None

    def _insert(self, ci: int, off: int, size: int, waits: tuple) -> None:
        free = self._free[ci]
        i = bisect.bisect_left(free, (off,), key=lambda r: r[:1])
        free.insert(i, (off, size, waits))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:  # merge with next
            free[i] = (off, size + free[i + 1][1], _merge(free[i][2], free[i + 1][2]))
            free.pop(i + 1)
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:  # merge with previous
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1], _merge(free[i - 1][2], free[i][2]))
            free.pop(i)


def _merge(a: tuple, b: tuple) -> tuple:
    if not a:
        return b
    if not b:
        return a
    return tuple(e for e in a + b if not e.query())  # done events need no wait; keeps the tuples short


class _Batch:
    """The stores of one unit's forward: their sources stay alive until the compute stream waited on them."""

    __slots__ = ("sources", "event")

    def __init__(self) -> None:
        self.sources: list[torch.Tensor] = []
        self.event = None


class HostTier:
    """Entries live in a :class:`HostPool`; device -> host and host -> device copies run on two streams."""

    name = "host"

    def __init__(self, device: torch.device, *, pool_bytes: int) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise OffloadError(f"the host offload tier needs a CUDA device (got {device}); on CPU-only runs "
                               f"use MEMRT_OFFLOAD=disk (host memory is the device memory there)")
        self.device = device
        self.pool = HostPool(pool_bytes, pin=True)
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        self.cond = threading.Condition(threading.RLock())
        self.bytes_written = 0
        self.bytes_read = 0
        self.copy_events: list[tuple[object, object]] = []  # (start, end) of every copy, for timing
        self.time_copies = False

    @property
    def stream(self) -> torch.cuda.Stream:
        """The device -> host copy stream (the one offloads are queued on)."""
        return self.d2h

    def new_file(self, unit_index: int) -> _Batch:
        return _Batch()

    def seal(self, file: _Batch) -> None:
        pass

    def wait_written(self, file: _Batch) -> float:
        """The next unit's forward is queued: the compute stream waits (GPU side) for this unit's copies
        and their sources go back to its pool in stream order."""
        if file.event is not None:
            torch.cuda.current_stream(self.device).wait_event(file.event)
        file.sources.clear()
        return 0.0

    def _timed(self, stream):
        if not self.time_copies:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def store(self, entry, src_u8: torch.Tensor, file: _Batch) -> float:
        block = self.pool.alloc(entry.nbytes)
        waits = self.pool.last_waits
        producer = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(producer)  # the activation is written by work already queued there
        for ev in waits:  # the range's previous load (other stream) must have read it
            self.d2h.wait_event(ev)
        with torch.cuda.stream(self.d2h):
            start = self._timed(self.d2h)
            block[3].copy_(src_u8, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.time_copies)
            done.record(self.d2h)
        file.sources.append(src_u8)  # freed after the compute stream waited on ``done`` (wait_written)
        file.event = done
        if start is not None:
            self.copy_events.append((start, done))
        entry.host = block
        entry.event = done
        self.bytes_written += entry.nbytes
        return 0.0

    def load(self, entry, *, urgent: bool = False) -> None:
        with self.cond:
            if entry.data is not None or entry.freed:
                return
            consumer = torch.cuda.current_stream(self.device)
            dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)  # consumer stream's pool
            self.h2d.wait_stream(consumer)  # dst's block may have been used by queued compute work
            self.h2d.wait_event(entry.event)  # the store that wrote the host range
            with torch.cuda.stream(self.h2d):
                start = self._timed(self.h2d)
                dst.copy_(entry.host[3], non_blocking=True)
                done = torch.cuda.Event(enable_timing=self.time_copies)
                done.record(self.h2d)
            if start is not None:
                self.copy_events.append((start, done))
            entry.data = dst
            entry.stream = consumer  # the stream dst was allocated on (read by wait and drop)
            entry.event = done
            self.bytes_read += entry.nbytes

    def wait(self, entry) -> tuple[torch.Tensor, float]:
        with self.cond:
            if entry.freed:
                raise OffloadError("an offloaded activation was used after it was released")
            if entry.data is None:
                self.load(entry, urgent=True)
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(entry.event)  # GPU-side wait: the host thread does not block
            if entry.stream is not None and entry.stream != consumer:
                entry.data.record_stream(consumer)  # used on another stream than it was allocated on
            return entry.data, 0.0

    def drop(self, entry) -> None:
        with self.cond:
            self._release_data(entry)

    def _release_data(self, entry) -> None:
        """Forget the loaded block; a load never waited on is waited on by its stream first (GPU side), so the
        block is not handed out while the copy still writes it."""
        if entry.data is not None and entry.stream is not None and entry.event is not None:
            entry.stream.wait_event(entry.event)
        entry.data = None
        entry.stream = None

    def free(self, entry) -> None:
        with self.cond:
            self._release_data(entry)
            entry.freed = True
            if entry.host is not None:
                self.pool.free(entry.host, entry.event)  # reused once the last copy touching it is done
                entry.host = None

    def check(self) -> None:
        pass

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()

    def close(self) -> None:
        self.synchronize()

    def copy_seconds(self) -> float:
        """Total device time of the copies recorded while ``time_copies`` was on (synchronizes)."""
        self.synchronize()
        total = sum(s.elapsed_time(e) for s, e in self.copy_events) / 1e3
        self.copy_events.clear()
        return total
