"""The offload engine: saved-tensor hooks that move a unit's activations to a tier and back.

``with engine.pack_hooks(i): out = unit(x)`` installs ``torch.autograd.graph.saved_tensors_hooks``
for the forward of unit ``i``. Each tensor autograd saves is either kept as is (parameters and views
of them, registered storages such as buffers, tensors below ``min_bytes``, non-strided or exotic
tensors) or its whole storage is handed to the tier once (views of a storage stored already share
it: deduplicated by storage, checked with a weak reference so a recycled address never matches) and
autograd keeps a small handle. In backward the first use of a unit's handles (or
``before_backward(i)``) loads that unit and starts loading the unit that backward needs next.
A handle's storage is released when autograd frees the handle (end of backward or graph dropped).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from memrt.memory.offload import cleanup
from memrt.memory.offload.errors import OffloadError
from memrt.memory.offload.stats import OffloadStats

__all__ = ["OffloadEngine", "OffloadStats", "TIERS", "plan_bytes"]

logger = logging.getLogger(__name__)

TIERS = ("disk", "host")
_DEFAULT_MIN_BYTES = 64 * 1024
_DEFAULT_PENDING_BYTES = 256 * 1024 * 1024


class _Held:
    """Running total of the device bytes the engine's entries hold (updated as entries change state)."""

    __slots__ = ("bytes", "peak", "lock", "cpu")

    def __init__(self, cpu: bool) -> None:
        self.bytes = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.cpu = cpu


class _Entry:
    """One stored storage. ``src`` / ``data`` / ``loading`` keep the engine's held-bytes total current."""

    __slots__ = ("nbytes", "group", "file", "offset", "_src", "_data", "_loading", "freed", "crc", "host",
                 "event", "stream", "refs", "uses_left", "storage_ref", "key", "held", "__weakref__")

    def __init__(self, nbytes: int, group: "_Group", held: _Held | None = None) -> None:
        self.nbytes = nbytes
        self.group = group
        self.held = held
        self.file = None
        self.offset = 0
        self._src = None
        self._data = None
        self._loading = False
        self.freed = False
        self.crc = 0
        self.host = None
        self.event = None
        self.stream = None
        self.refs = 0
        self.uses_left = 0
        self.storage_ref = None
        self.key = 0

    def _holds(self) -> bool:
        held = self.held
        return (self._src is not None and held is not None and held.cpu) or self._data is not None or self._loading

    def _set(self, name: str, value) -> None:
        held = self.held
        if held is None:
            object.__setattr__(self, name, value)
            return
        with held.lock:
            before = self._holds()
            object.__setattr__(self, name, value)
            after = self._holds()
            if before != after:
                held.bytes += self.nbytes if after else -self.nbytes
                if held.bytes > held.peak:
                    held.peak = held.bytes

    src = property(lambda self: self._src, lambda self, v: self._set("_src", v))
    data = property(lambda self: self._data, lambda self, v: self._set("_data", v))
    loading = property(lambda self: self._loading, lambda self, v: self._set("_loading", v))


class _Group:
    """The entries packed during one call of one unit."""

    __slots__ = ("unit", "entries", "file", "backward_started", "live")

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.entries: list[_Entry] = []
        self.file = None
        self.backward_started = False
        self.live = 0


class _Store:
    """Packs tensors into one group of the engine (see :meth:`OffloadEngine.packing`)."""

    __slots__ = ("engine", "group")

    def __init__(self, engine: "OffloadEngine", group: _Group) -> None:
        self.engine, self.group = engine, group

    def pack(self, t: torch.Tensor):
        return self.engine._pack(t, self.group)

    def unpack(self, obj) -> torch.Tensor:
        return self.engine._unpack(obj)


class _Handle:
    """What autograd keeps instead of the tensor: entry + view geometry."""

    __slots__ = ("engine", "entry", "offset", "size", "stride", "dtype", "device", "__weakref__")

    def __init__(self, engine, entry, t: torch.Tensor) -> None:
        self.engine = engine
        self.entry = entry
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device

    def __del__(self) -> None:
        try:
            self.engine._release(self.entry)
        except Exception:  # interpreter shutdown or engine closed: nothing left to release
            pass


class OffloadEngine:
    """Moves saved activations of marked units to ``tier`` ('disk' or 'host') and back for backward.

    Args:
        tier: 'disk' (files, any device) or 'host' (pinned host memory, CUDA only).
        device: the training device (default: current CUDA device if available, else CPU).
        directory: parent folder for the disk tier's private folder (default MEMRT_OFFLOAD_DIR,
            else the system temp dir). The private folder (0700, files 0600) is removed by
            ``close()``, at exit and on SIGTERM.
        min_bytes: saved tensors smaller than this stay on the device.
        verify: CRC32 of every disk write checked on read (default: on when MEMRT_LOG_LEVEL=debug).
        prefetch_units: how many units ahead of backward are loaded.
        max_pending_bytes: bytes waiting to be written before ``pack`` blocks (disk tier).
        host_pool_bytes: pinned pool size for the host tier (from the plan; grows if short).
        keep: modules whose parameters and buffers are never offloaded (e.g. the model).
        required_bytes: bytes the plan moves to this tier per step: the disk tier checks the folder's
            free space against it now (before training), the host tier sizes its pinned pool with it.
    """

    def __init__(self, tier: str, *, device: str | torch.device | None = None,
                 directory: str | Path | None = None, min_bytes: int = _DEFAULT_MIN_BYTES,
                 verify: bool | None = None, prefetch_units: int = 1,
                 max_pending_bytes: int = _DEFAULT_PENDING_BYTES, host_pool_bytes: int = 0,
                 keep: nn.Module | None = None, record: bool = True, required_bytes: int = 0) -> None:
        if tier not in TIERS:
            raise OffloadError(f"unknown offload tier {tier!r}: expected one of {', '.join(TIERS)} (MEMRT_OFFLOAD)")
        if min_bytes < 0 or prefetch_units < 0:
            raise ValueError(f"min_bytes={min_bytes} and prefetch_units={prefetch_units} must be >= 0")
        self.device = _training_device(device)
        self.tier_name = tier
        self.min_bytes = int(min_bytes)
        self.prefetch_units = int(prefetch_units)
        self._record = record
        self._lock = threading.RLock()
        self._closed = False
        self._by_storage: dict[int, _Entry] = {}
        self._order: list[_Group] = []
        self._previous_sealed: _Group | None = None
        self._keep_ptrs: set[int] = set()
        self._n = dict(offloaded=0, dedup=0, small=0, param=0, hits=0, misses=0)
        self._wait_seconds = 0.0
        self._live: set[_Entry] = set()
        self._held = _Held(self.device.type == "cpu")
        self._sources_pending = False
        self.directory: Path | None = None
        if keep is not None:
            self.keep_storages(keep)
        self._tier, self.directory = _open_tier(tier, self.device, directory=directory, verify=verify,
                                                max_pending_bytes=max_pending_bytes, host_pool_bytes=host_pool_bytes,
                                                required_bytes=required_bytes,
                                                on_trace=_record_trace if record else None)
        self._finalizer = weakref.finalize(self, _close_tier, self._tier, self.directory)
        if required_bytes and tier == "disk":
            try:
                self.check_space(required_bytes)
            except OffloadError:
                self._finalizer()
                raise

    # ---- public API ---------------------------------------------------------------------------
    def keep_storages(self, module: nn.Module) -> None:
        """Never offload the parameters and buffers of ``module`` (nor views of them)."""
        for t in list(module.parameters()) + list(module.buffers()):
            self._keep_ptrs.add(t.untyped_storage().data_ptr())

    def check_space(self, required_bytes: int, *, margin: float = 0.1) -> None:
        """Raise :class:`OffloadError` naming the folder when it cannot hold ``required_bytes`` (+margin)."""
        if self.directory is not None:
            check_free_space(self.directory, required_bytes, margin=margin)

    @contextlib.contextmanager
    def pack_hooks(self, unit_index: int) -> Iterator[None]:
        """Offload what autograd saves during this block (the forward of unit ``unit_index``)."""
        with self.packing(unit_index) as store:
            with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
                yield

    @contextlib.contextmanager
    def packing(self, unit_index: int) -> Iterator["_Store"]:
        """A store for tensors of unit ``unit_index`` (``pack(t)`` -> handle or ``t``, ``unpack(handle)``),
        e.g. the inputs of a recomputed unit (:func:`memrt.memory.recompute.run_recomputed`)."""
        self._check_open()
        group = _Group(int(unit_index))
        with self._lock:
            self._order.append(group)
        try:
            yield _Store(self, group)
        finally:
            with self._lock:
                if group.file is not None:
                    self._tier.seal(group.file)
                previous = self._previous_sealed
                self._previous_sealed = group
                if group.live == 0 and group in self._order:
                    self._order.remove(group)
            # bounded in-flight writes: while the next unit runs, only this unit's writes may be pending
            if previous is not None and previous.file is not None:
                self._wait_seconds += self._tier.wait_written(previous.file)

    def before_backward(self, unit_index: int) -> None:
        """Backward of unit ``unit_index`` is about to run: load it and prefetch the next ones needed."""
        self._check_open()
        with self._lock:
            for group in reversed(self._order):
                if group.unit == unit_index and not group.backward_started:
                    self._start_backward(group)
                    return

    def stats(self) -> OffloadStats:
        return _stats(self.tier_name, self.device, self.directory, self._tier, self._n,
                      held_bytes=self._held.bytes, held_peak_bytes=self._held.peak, wait_seconds=self._wait_seconds)

    def publish(self) -> OffloadStats:
        """Put the current stats in the recorder's meta (key ``offload``) and return them."""
        s = self.stats()
        if self._record:
            from memrt.profiling.recorder import get_recorder

            get_recorder().set_meta(offload=asdict(s))
        return s

    def synchronize(self) -> None:
        """Wait for every queued transfer (disk tier: writes and reads; host tier: the copy stream)."""
        io = getattr(self._tier, "io", None)
        if io is not None:
            io.drain()
            self._tier.check()
        elif self.tier_name == "host":
            self._tier.synchronize()

    def close(self) -> None:
        """Stop the I/O thread and remove every offload file. Idempotent."""
        if self._closed:
            return
        try:
            self.publish()
        except Exception:  # stats are best effort at close
            logger.debug("could not publish offload stats", exc_info=True)
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- hooks ----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor, group: _Group):
        if self._closed:
            return t
        stays = _stays_on_device(t, self.device, self.min_bytes, self._keep_ptrs)
        if stays is not None:
            self._n[stays] += 1
            return t
        storage = t.untyped_storage()
        nbytes, key = storage.nbytes(), storage.data_ptr()
        self._tier.check()
        with self._lock:
            entry = self._by_storage.get(key)
            if entry is not None and not entry.freed and entry.storage_ref() is storage:
                self._n["dedup"] += 1
            else:
                entry = _Entry(nbytes, group, self._held)
                entry.storage_ref = weakref.ref(storage)
                entry.key = key
                self._by_storage[key] = entry
                group.entries.append(entry)
                group.live += 1
                if group.file is None:
                    group.file = self._tier.new_file(group.unit)
                self._live.add(entry)
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                self._wait_seconds += self._tier.store(entry, src, group.file)
                self._sources_pending = True
                del src
            entry.refs += 1
            entry.uses_left += 1
            self._n["offloaded"] += 1
            return _Handle(self, entry, t)

    def _unpack(self, obj):
        if not isinstance(obj, _Handle):
            return obj
        entry = obj.entry
        with self._lock:
            if self._closed:
                raise OffloadError("the offload engine was closed before backward used its activations; "
                                   "keep it open until backward finishes")
            group = entry.group
            if not group.backward_started:
                self._start_backward(group)
            if entry.data is not None or entry.loading:
                self._n["hits"] += 1
            else:
                self._n["misses"] += 1
        data, waited = self._tier.wait(entry)
        with self._lock:
            self._wait_seconds += waited
            entry.uses_left -= 1
            if entry.uses_left <= 0:
                self._tier.drop(entry)  # our copy goes; the returned view keeps what backward uses
        return torch.empty(0, dtype=obj.dtype, device=data.device).set_(
            data.untyped_storage(), obj.offset, obj.size, obj.stride)

    # ---- internals ------------------------------------------------------------------------------
    def _start_backward(self, group: _Group) -> None:
        group.backward_started = True
        if self._sources_pending and self.tier_name == "host":  # forward is over: no unit ends after the last
            self._sources_pending = False
            for g in self._order:
                if g.file is not None:
                    self._tier.wait_written(g.file)
        self._load_group(group, urgent=True)
        idx = self._order.index(group) if group in self._order else -1
        ahead = 0
        for prev in reversed(self._order[:idx] if idx >= 0 else []):
            if ahead >= self.prefetch_units:
                break
            if not prev.backward_started and prev.live:
                self._load_group(prev)
                ahead += 1

    def _load_group(self, group: _Group, *, urgent: bool = False) -> None:
        for e in group.entries:
            if not e.freed and e.data is None and not e.loading:
                self._tier.load(e, urgent=urgent)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0 or entry.freed:
                return
            self._tier.free(entry)
            entry.loading = False  # a read queued before the free never completes: it holds nothing
            self._live.discard(entry)
            if self._by_storage.get(entry.key) is entry:
                del self._by_storage[entry.key]
            group = entry.group
            group.live -= 1
            if group.live == 0 and group in self._order:
                self._order.remove(group)

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this offload engine is closed; create a new one (memrt.apply does this per plan)")
        self._tier.check()


def _training_device(device: str | torch.device | None) -> torch.device:
    """``device`` with its index filled in; by default the current CUDA device if there is one, else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _stays_on_device(t: torch.Tensor, device: torch.device, min_bytes: int, keep_ptrs: set[int]) -> str | None:
    """Why a saved tensor is not offloaded, as the stats counter it counts under ('param' for parameters,
    views of trainable leaves, kept storages and tensors the tier cannot hold; 'small' under ``min_bytes``),
    or None when it is offloaded."""
    if (t.layout != torch.strided or t.device != device or t.is_conj() or t.is_neg()
            or type(t) not in (torch.Tensor, nn.Parameter)):
        return "param"
    if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad) or (
            t._base is not None and t._base.is_leaf and t._base.requires_grad):
        return "param"
    storage = t.untyped_storage()
    if storage.nbytes() < min_bytes or t.numel() * t.element_size() < min_bytes:
        return "small"
    if storage.data_ptr() in keep_ptrs:
        return "param"
    return None


def _record_trace(name: str, start: float, end: float, **args) -> None:
    from memrt.profiling.recorder import get_recorder

    get_recorder().record_trace(name, start, end, **args)


def _open_tier(tier: str, device: torch.device, *, directory: str | Path | None, verify: bool | None,
               max_pending_bytes: int, host_pool_bytes: int, required_bytes: int,
               on_trace: Any) -> tuple[Any, Path | None]:
    """The tier's store and, for the disk tier, its private folder (made here)."""
    if tier == "host":
        from memrt.memory.offload.host import HostTier, pool_bytes_for

        return HostTier(device, pool_bytes=max(int(host_pool_bytes), pool_bytes_for(required_bytes))), None
    from memrt.config import load_config
    from memrt.memory.offload.disk import DiskTier

    config = load_config(warn_unknown=False) if directory is None or verify is None else None
    parent = directory if directory is not None else config.offload_dir
    if verify is None:
        verify = config.log_level == "debug"
    folder = cleanup.make_private_dir(parent)
    return DiskTier(folder, device, verify=bool(verify), max_pending_bytes=max_pending_bytes,
                    on_trace=on_trace), folder


def check_free_space(directory: Path, required_bytes: int, *, margin: float = 0.1) -> None:
    """Raise :class:`OffloadError` naming ``directory`` when it cannot hold ``required_bytes`` (+margin)."""
    import shutil

    free = shutil.disk_usage(directory).free
    need = int(required_bytes * (1.0 + margin))
    if free < need:
        from memrt.sizes import format_bytes

        raise OffloadError(
            f"offload folder {directory} has {format_bytes(free)} free but the plan writes up to "
            f"{format_bytes(required_bytes)} per step (+{margin:.0%} margin); set MEMRT_OFFLOAD_DIR to a "
            f"disk with more space, raise MEMRT_BUDGET, or set MEMRT_OFFLOAD=host|none")


def _stats(tier_name: str, device: torch.device, directory: Path | None, t: Any, n: dict[str, int], *,
           held_bytes: int, held_peak_bytes: int, wait_seconds: float) -> OffloadStats:
    pool = getattr(t, "pool", None)
    return OffloadStats(
        tier=tier_name, device=str(device), directory=str(directory) if directory is not None else None,
        tensors_offloaded=n["offloaded"], tensors_deduplicated=n["dedup"], tensors_kept_small=n["small"],
        tensors_kept_param=n["param"], bytes_offloaded=t.bytes_written, bytes_restored=t.bytes_read,
        device_held_bytes=held_bytes, device_held_peak_bytes=held_peak_bytes,
        host_bytes=pool.used_bytes if pool else 0, host_peak_bytes=pool.peak_bytes if pool else 0,
        host_pool_capacity_bytes=pool.capacity_bytes if pool else 0,
        pinned_allocations=pool.allocations if pool else 0,
        disk_bytes=getattr(t, "disk_bytes", 0), disk_peak_bytes=getattr(t, "disk_peak_bytes", 0),
        write_seconds=getattr(t, "write_seconds", 0.0), read_seconds=getattr(t, "read_seconds", 0.0),
        wait_seconds=wait_seconds, prefetch_hits=n["hits"], prefetch_misses=n["misses"])

def plan_bytes(plan, tier: str) -> int:
    """Bytes a plan (``memrt.Plan``-like: ``units`` with ``action`` and ``bytes_moved``) sends to ``tier`` per step."""
    if plan is None:
        return 0
    return int(sum(getattr(u, "bytes_moved", 0) or 0 for u in getattr(plan, "units", ())
                   if str(getattr(u, "action", "")).endswith(f"offload_{tier}")))


def _close_tier(tier, directory: Path | None) -> None:
    try:
        tier.close()
    finally:
        if directory is not None:
            cleanup.remove_dir(directory)
