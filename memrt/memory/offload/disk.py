"""Disk tier: saved activations written to files by a background I/O thread and read back ahead of need.

Layout: one file per unit call (``unit<index>-<group>.bin``, mode 0600) in the engine's private folder;
each stored storage gets a fixed byte range decided when it is packed, so writes and reads never move
data around. All file operations (write, read, close and unlink) run on the one I/O thread, in order,
so a file is never closed under a pending write. The queue is bounded in bytes: ``pack`` waits when
more than ``max_pending_bytes`` wait to be written (the memory of in-flight writes stays bounded).

Reads check the size always and a CRC32 in verify (debug) mode; a short or corrupt read raises
:class:`OffloadError` naming the file instead of handing back wrong data.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import torch

from memrt.memory.offload.errors import OffloadError

__all__ = ["IOThread", "DiskTier"]

logger = logging.getLogger(__name__)

_WAIT_TIMEOUT_S = 600.0
_ALIGN = 4096


class IOThread:
    """One background thread running submitted jobs in order; bounded by pending bytes."""

    def __init__(self, name: str, max_pending_bytes: int) -> None:
        self.cond = threading.Condition(threading.RLock())
        self._jobs: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._max_pending = max(1, int(max_pending_bytes))
        self._stop = False
        self.error: BaseException | None = None
        self.busy_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], nbytes: int = 0, *, front: bool = False) -> float:
        """Queue ``fn``; wait while the queue holds too many bytes. Returns seconds spent waiting."""
        waited = 0.0
        with self.cond:
            if nbytes and self._pending_bytes and self._pending_bytes + nbytes > self._max_pending:
                t0 = time.perf_counter()
                deadline = t0 + _WAIT_TIMEOUT_S
                while (self._pending_bytes and self._pending_bytes + nbytes > self._max_pending
                       and self.error is None and not self._stop):
                    if not self.cond.wait(timeout=min(1.0, deadline - time.perf_counter())) and \
                            time.perf_counter() >= deadline:
                        raise OffloadError(f"offload I/O made no progress for {_WAIT_TIMEOUT_S:.0f} s")
                waited = time.perf_counter() - t0
            if self._stop:
                return waited
            self._pending_bytes += nbytes
            job = (fn, nbytes)
            if front:
                self._jobs.appendleft(job)
            else:
                self._jobs.append(job)
            self.cond.notify_all()
        return waited

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._jobs and not self._stop:
                    self.cond.wait()
                if not self._jobs:
                    return  # stopped and drained
                fn, nbytes = self._jobs.popleft()
            t0 = time.perf_counter()
            try:
                if self.error is None or getattr(fn, "always", False):
                    fn()
            except BaseException as exc:  # handed to the main thread, which raises it
                logger.debug("offload I/O job failed", exc_info=True)
                with self.cond:
                    self.error = exc
            finally:
                self.busy_seconds += time.perf_counter() - t0
                with self.cond:
                    self._pending_bytes -= nbytes
                    self.cond.notify_all()

    def drain(self, timeout: float = _WAIT_TIMEOUT_S) -> None:
        """Wait until every queued job ran."""
        done = threading.Event()

        def mark() -> None:
            done.set()

        mark.always = True  # type: ignore[attr-defined]  # also after an I/O error
        self.submit(mark)
        if not done.wait(timeout) and self._thread.is_alive():
            raise OffloadError(f"offload I/O did not finish within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class _File:
    """The file of one unit call: byte ranges handed out in pack order."""

    __slots__ = ("path", "fd", "size", "live", "sealed", "removed", "pending")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = 0
        self.live = 0
        self.sealed = False
        self.removed = False
        self.pending = 0  # writes queued, not yet done

    def reserve(self, nbytes: int) -> int:
        offset = self.size
        self.size += -(-nbytes // _ALIGN) * _ALIGN
        self.live += 1
        return offset


class DiskTier:
    """Stores entries (see :mod:`memrt.memory.offload.engine`) in files; loads them back asynchronously."""

    name = "disk"

    def __init__(self, directory: Path, device: torch.device, *, verify: bool, max_pending_bytes: int,
                 on_trace: Callable[..., None] | None = None) -> None:
        self.directory = Path(directory)
        self.device = device
        self.verify = verify
        self.io = IOThread(f"memrt-offload-io-{os.getpid()}", max_pending_bytes)
        self.cond = self.io.cond
        self._trace = on_trace
        self._files = 0
        self.disk_bytes = 0
        self.disk_peak_bytes = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_seconds = 0.0
        self.read_seconds = 0.0

    # ---- called on the main (or autograd) thread -------------------------------------------
    def new_file(self, unit_index: int) -> _File:
        self._files += 1
        try:
            return _File(self.directory / f"unit{unit_index}-{self._files}.bin")
        except OSError as exc:
            raise self._error(exc) from exc

    def store(self, entry, src_u8: torch.Tensor, file: _File) -> float:
        """Queue ``src_u8`` (the whole storage as bytes) for writing; returns seconds waited on back-pressure."""
        if self.device.type == "cuda":
            src_u8, entry.event = self._to_pinned(src_u8)  # the I/O thread waits for the copy, not this one
        elif self.device.type != "cpu":
            src_u8 = src_u8.to("cpu")  # other accelerators: plain synchronous copy
        entry.file = file
        entry.offset = file.reserve(entry.nbytes)
        entry.src = src_u8
        with self.cond:
            file.pending += 1
            self.disk_bytes += entry.nbytes
            self.disk_peak_bytes = max(self.disk_peak_bytes, self.disk_bytes)
        return self.io.submit(lambda: self._write(entry), entry.nbytes)

    def _to_pinned(self, src_u8: torch.Tensor):
        """A pinned host copy of a CUDA source queued on a side stream, and the event that says it landed.

        Pinned blocks come from torch's caching host allocator (reused from the second step on); the
        source is ``record_stream``-ed on the side stream so its block is not reused before it was read."""
        stream = getattr(self, "_d2h", None)
        if stream is None:
            stream = self._d2h = torch.cuda.Stream(device=self.device)
        host = torch.empty(src_u8.numel(), dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(src_u8, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        src_u8.record_stream(stream)
        return host, done

    def load(self, entry, *, urgent: bool = False) -> None:
        """Start bringing ``entry`` back (no-op if already there or on its way)."""
        with self.cond:
            if entry.data is not None or entry.loading or entry.freed:
                return
            if entry.src is not None:  # not written yet: use the bytes still in memory
                entry.data = entry.src
                return
            entry.loading = True
        dst = torch.empty(entry.nbytes, dtype=torch.uint8)  # allocated here: counted by memory trackers
        self.io.submit(lambda: self._read(entry, dst), 0, front=urgent)

    def wait(self, entry) -> tuple[torch.Tensor, float]:
        """The entry's bytes on the device, waiting for the load if needed; and seconds waited."""
        waited = 0.0
        with self.cond:
            if entry.data is None:
                self.check()
                if not entry.loading:
                    self.load(entry, urgent=True)
                t0 = time.perf_counter()
                while entry.data is None:
                    self.check()
                    if entry.freed:
                        raise OffloadError("an offloaded activation was used after it was released")
                    self.cond.wait(timeout=1.0)
                    if time.perf_counter() - t0 > _WAIT_TIMEOUT_S:
                        raise OffloadError(f"reading offloaded activations from {self.directory} took over "
                                           f"{_WAIT_TIMEOUT_S:.0f} s")
                waited = time.perf_counter() - t0
            data = entry.data
        if data.device != self.device:
            if entry.event is not None and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).wait_event(entry.event)  # the bytes may still be landing
            data = data.to(self.device)
        return data, waited

    def drop(self, entry) -> None:
        """Forget the loaded copy (the file stays, a later use reads it again)."""
        with self.cond:
            if entry.src is None:
                entry.data = None

    def free(self, entry) -> None:
        """The entry is gone for good: release memory and its file range, the file when empty."""
        with self.cond:
            entry.freed = True
            entry.src = None
            entry.data = None
            self.disk_bytes -= entry.nbytes
            f = entry.file
            if f is not None:
                f.live -= 1
                if f.live == 0 and f.sealed:
                    self._remove_file_later(f)
            self.cond.notify_all()

    def seal(self, file: _File) -> None:
        """No more entries go into ``file`` (its unit call ended)."""
        with self.cond:
            file.sealed = True
            if file.live == 0:
                self._remove_file_later(file)

    def check(self) -> None:
        if self.io.error is not None:
            exc = self.io.error
            raise exc if isinstance(exc, OffloadError) else self._error(exc)

    def close(self) -> None:
        self.io.stop()

    # ---- I/O thread ---------------------------------------------------------------------------
    def _remove_file_later(self, f: _File) -> None:
        if f.removed:
            return
        f.removed = True

        def remove() -> None:
            os.close(f.fd)
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass

        remove.always = True  # type: ignore[attr-defined]  # runs even after an I/O error
        self.io.submit(remove)

    def wait_written(self, file: _File | None) -> float:
        """Block until every write queued for ``file`` is done (bounds in-flight writes to one unit)."""
        if file is None:
            return 0.0
        with self.cond:
            if file.pending == 0:
                return 0.0
            t0 = time.perf_counter()
            while file.pending > 0:
                self.check()
                self.cond.wait(timeout=1.0)
                if time.perf_counter() - t0 > _WAIT_TIMEOUT_S:
                    raise OffloadError(f"writing offloaded activations to {self.directory} took over "
                                       f"{_WAIT_TIMEOUT_S:.0f} s")
            return time.perf_counter() - t0

    def _write(self, entry) -> None:
        try:
            self._write_entry(entry)
        finally:
            with self.cond:
                entry.file.pending -= 1
                self.cond.notify_all()

    def _write_entry(self, entry) -> None:
        src = entry.src
        if src is None or entry.freed:
            return
        t0 = time.perf_counter()
        if entry.event is not None:  # CUDA source: its copy to pinned memory was queued on a side stream
            entry.event.synchronize()
        view = memoryview(src.numpy()).cast("B")
        if self.verify:
            entry.crc = zlib.crc32(view)
        done = 0
        try:
            while done < entry.nbytes:
                n = os.pwrite(entry.file.fd, view[done:], entry.offset + done)
                if n <= 0:
                    raise OSError(f"write returned {n}")
                done += n
        except OSError as exc:
            raise self._error(exc) from exc
        t1 = time.perf_counter()
        with self.cond:
            self.write_seconds += t1 - t0
            self.bytes_written += entry.nbytes
            entry.src = None  # the activation's memory can go now
            self.cond.notify_all()
        del src, view
        if self._trace is not None:
            self._trace("offload_write", t0, t1, bytes=entry.nbytes)

    def _read(self, entry, dst: torch.Tensor) -> None:
        if entry.freed:
            return
        t0 = time.perf_counter()
        view = memoryview(dst.numpy()).cast("B")
        done = 0
        try:
            while done < entry.nbytes:
                n = os.preadv(entry.file.fd, [view[done:]], entry.offset + done)
                if n <= 0:
                    break
                done += n
        except OSError as exc:
            raise self._error(exc) from exc
        if done != entry.nbytes:
            raise OffloadError(
                f"short read of offloaded activations from {entry.file.path}: got {done} of {entry.nbytes} "
                f"bytes at offset {entry.offset}; the file was truncated or modified while training ran "
                f"(keep MEMRT_OFFLOAD_DIR private to this job)")
        if self.verify and zlib.crc32(view) != entry.crc:
            raise OffloadError(
                f"corrupt offloaded activations in {entry.file.path} (CRC32 mismatch at offset {entry.offset}, "
                f"{entry.nbytes} bytes); the file was modified while training ran or the disk returned bad data")
        t1 = time.perf_counter()
        with self.cond:
            self.read_seconds += t1 - t0
            self.bytes_read += entry.nbytes
            entry.loading = False
            if not entry.freed:
                entry.data = dst
            self.cond.notify_all()
        if self._trace is not None:
            self._trace("offload_read", t0, t1, bytes=entry.nbytes)

    def _error(self, exc: BaseException) -> OffloadError:
        return OffloadError(
            f"offloading activations to {self.directory} failed: {exc}. Point MEMRT_OFFLOAD_DIR at a writable "
            f"directory with enough free space, or set MEMRT_OFFLOAD=none (or a larger MEMRT_BUDGET)")
