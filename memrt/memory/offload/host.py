"""Host tier (CUDA): saved activations copied to a pre-sized, reused pinned-memory pool on a side stream.

- :class:`HostPool` hands out byte ranges of a few large pinned buffers (first fit, coalescing free
  list). It is sized once (from the plan, ``host_pool_bytes``) and reused every step; when a step
  needs more it grows, and once empty again it is merged into one buffer of the total size, so from
  the second step on there are no pinned allocations (``stats().pinned_allocations`` counts them). A range is reused only after the copies that touch it have finished (events).
- :class:`HostTier` copies device -> host on a dedicated stream after waiting for the producing
  stream; the source block is ``record_stream``-ed on the side stream so the caching allocator does
  not hand it out while the copy reads it. Loads copy host -> device on the same side stream into a
  block allocated there; the consumer stream waits on the copy's event and the block is
  ``record_stream``-ed on the consumer so it outlives its use in backward.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import torch

from memrt.memory.offload.errors import OffloadError

__all__ = ["HostPool", "HostTier"]

logger = logging.getLogger(__name__)

_ALIGN = 512


class HostPool:
    """Sub-allocates large (pinned when ``pin``) uint8 buffers; ``free(block, event)`` defers reuse."""

    def __init__(self, capacity_bytes: int, *, pin: bool = True) -> None:
        self.pin = pin
        self._lock = threading.Lock()
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (offset, size)
        self._pending: list[tuple[int, int, int, object]] = []  # (chunk, offset, size, event)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0  # pinned (or plain) buffer allocations ever made
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
        self._free.append([(0, nbytes)])
        self.allocations += 1
        logger.debug("host pool: new %s buffer of %d bytes", "pinned" if self.pin else "plain", nbytes)

    def alloc(self, nbytes: int) -> tuple[int, int, int, torch.Tensor]:
        """A block ``(chunk, offset, size, view)`` of at least ``nbytes``."""
        size = -(-max(1, int(nbytes)) // _ALIGN) * _ALIGN
        with self._lock:
            self._collect(block=False)
            if self.used_bytes == 0 and len(self._chunks) > 1:
                self._consolidate()
            found = self._find(size)
            if found is None and self._pending:
                self._collect(block=True)
                found = self._find(size)
            if found is None:
                self._grow(max(size, self.capacity_bytes // 2))
                found = self._find(size)
            ci, off = found
            self.used_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return ci, off, size, self._chunks[ci][off:off + int(nbytes)]

    def free(self, block: tuple[int, int, int, torch.Tensor], event=None) -> None:
        """Return ``block``; reuse waits for ``event`` (a CUDA event of the last copy touching it)."""
        ci, off, size, _ = block
        with self._lock:
            self.used_bytes -= size
            if event is None:
                self._insert(ci, off, size)
            else:
                self._pending.append((ci, off, size, event))

    def _consolidate(self) -> None:
        """All free after a step that outgrew the pool: one buffer of the total size from now on."""
        self._collect(block=True)
        total = self.capacity_bytes
        self._chunks.clear()
        self._free.clear()
        self._grow(total)

    def _collect(self, *, block: bool) -> None:
        keep = []
        for ci, off, size, ev in self._pending:
            if block:
                ev.synchronize()
            if block or ev.query():
                self._insert(ci, off, size)
            else:
                keep.append((ci, off, size, ev))
        self._pending = keep

    def _find(self, size: int) -> tuple[int, int] | None:
        for ci, free in enumerate(self._free):
            for i, (off, sz) in enumerate(free):
                if sz >= size:
                    if sz == size:
                        free.pop(i)
                    else:
                        free[i] = (off + size, sz - size)
                    return ci, off
        return None

    def _insert(self, ci: int, off: int, size: int) -> None:
        free = self._free[ci]
        i = bisect.bisect_left(free, (off, 0))
        free.insert(i, (off, size))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:  # merge with next
            free[i] = (off, size + free[i + 1][1])
            free.pop(i + 1)
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:  # merge with previous
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            free.pop(i)


class HostTier:
    """Entries live in a :class:`HostPool`; copies run on one dedicated CUDA stream."""

    name = "host"

    def __init__(self, device: torch.device, *, pool_bytes: int) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise OffloadError(f"the host offload tier needs a CUDA device (got {device}); on CPU-only runs "
                               f"use MEMRT_OFFLOAD=disk (host memory is the device memory there)")
        self.device = device
        self.pool = HostPool(pool_bytes, pin=True)
        self.stream = torch.cuda.Stream(device=device)
        self.cond = threading.Condition(threading.RLock())
        self.bytes_written = 0
        self.bytes_read = 0
        self.copy_events: list[tuple[object, object]] = []  # (start, end) of every copy, for timing
        self.time_copies = False

    def new_file(self, unit_index: int):
        return None

    def seal(self, file) -> None:
        pass

    def wait_written(self, file) -> float:
        return 0.0  # copies are stream-ordered; record_stream keeps sources until they are done

    def _timed(self):
        if not self.time_copies:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        return start

    def store(self, entry, src_u8: torch.Tensor, file) -> float:
        block = self.pool.alloc(entry.nbytes)
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)  # the activation is written by work already queued there
        with torch.cuda.stream(self.stream):
            start = self._timed()
            block[3].copy_(src_u8, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.time_copies)
            done.record(self.stream)
        src_u8.record_stream(self.stream)  # its block is not reused before the copy has read it
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
            with torch.cuda.stream(self.stream):
                start = self._timed()
                dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
                dst.copy_(entry.host[3], non_blocking=True)
                done = torch.cuda.Event(enable_timing=self.time_copies)
                done.record(self.stream)
            if start is not None:
                self.copy_events.append((start, done))
            entry.data = dst
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
            entry.data.record_stream(consumer)  # the block lives until the consumer's use is done
            return entry.data, 0.0

    def drop(self, entry) -> None:
        with self.cond:
            entry.data = None

    def free(self, entry) -> None:
        with self.cond:
            entry.freed = True
            entry.data = None
            if entry.host is not None:
                self.pool.free(entry.host, entry.event)  # reused once the last copy touching it is done
                entry.host = None

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.stream.synchronize()

    def copy_seconds(self) -> float:
        """Total device time of the copies recorded while ``time_copies`` was on (synchronizes)."""
        self.stream.synchronize()
        total = sum(s.elapsed_time(e) for s, e in self.copy_events) / 1e3
        self.copy_events.clear()
        return total
