"""Measured transfer speeds for the offload cost model: disk write/read, device<->host copies.

Probed once per (device, filesystem) and cached in ``$XDG_CACHE_HOME/memrt/bandwidth.json`` (else
``~/.cache/memrt/bandwidth.json``). The disk probe uses the engine's own path (``pwrite``/``preadv``
of one buffer into a fresh file, no fsync), so it measures what offloading sees: for files that
fit in the page cache that is memory speed, for larger ones the device's. The copy probe times
pinned host <-> device copies with CUDA events.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memrt.memory.offload import cleanup
from memrt.memory.offload.errors import OffloadError

__all__ = ["Bandwidths", "probe_bandwidths", "load_bandwidths", "default_cache_path"]

logger = logging.getLogger(__name__)

_PROBE_BYTES = 32 * 1024 * 1024


@dataclass(kw_only=True, slots=True)
class Bandwidths:
    """Transfer speeds in bytes per second (None where a path does not exist on this device)."""

    device: str
    """Device kind the figures are for, e.g. 'cpu' or 'cuda:NVIDIA H200'."""
    disk_write_bytes_per_s: float
    """Writing offload files (page cache included, no fsync)."""
    disk_read_bytes_per_s: float
    """Reading them back."""
    d2h_bytes_per_s: float | None = None
    """Device -> pinned host copy (CUDA only)."""
    h2d_bytes_per_s: float | None = None
    """Pinned host -> device copy (CUDA only)."""
    directory: str = ""
    """Folder whose filesystem was probed."""
    probe_bytes: int = _PROBE_BYTES
    """Bytes moved per probe."""
    measured_at: float = 0.0
    """time.time() of the probe."""

    def __post_init__(self) -> None:
        for name in ("disk_write_bytes_per_s", "disk_read_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s"):
            v = getattr(self, name)
            if v is None and name.startswith(("d2h", "h2d")):
                continue
            if not _positive(v):
                raise ValueError(f"Bandwidths.{name}={v!r} is not valid: expected a finite number of bytes/s > 0")
        if not isinstance(self.device, str) or not isinstance(self.directory, str):
            raise ValueError(f"Bandwidths.device={self.device!r} / directory={self.directory!r}: expected strings")
        if not _positive(self.probe_bytes) or not isinstance(self.measured_at, (int, float)):
            raise ValueError(f"Bandwidths.probe_bytes={self.probe_bytes!r} / measured_at={self.measured_at!r} "
                             "are not valid: expected numbers")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Bandwidths":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: object) -> "Bandwidths":
        """Checked: raises ValueError (never TypeError) on a missing, extra or ill-typed field."""
        if not isinstance(d, dict):
            raise ValueError(f"expected an object of bandwidth figures, got {type(d).__name__}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def default_cache_path() -> Path:
    from memrt.config import cache_dir

    return Path(cache_dir()) / "bandwidth.json"


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _fs_key(directory: Path) -> str:
    try:
        return str(os.stat(directory).st_dev)
    except OSError:
        return str(directory)


_MIN_PROBE_BYTES = 256 * 1024


def _probe_size(directory: str, nbytes: int) -> int:
    """Bytes the disk probe may write in ``directory``: at most an eighth of the room other processes have not
    reserved (ranks sharing a small folder may be writing activations while this one probes)."""
    from memrt.memory.offload.folder import room_left

    return int(min(nbytes, max(_MIN_PROBE_BYTES, room_left(directory) // 8)))


def _probe_disk(directory: str | None, nbytes: int) -> tuple[float, float, str, int]:
    if directory is not None:
        nbytes = _probe_size(directory, nbytes)
    folder = cleanup.make_private_dir(directory)
    try:
        # incompressible bytes from a private generator: the user's RNG streams stay untouched
        gen = torch.Generator().manual_seed(0x6D656D)
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        view = memoryview(buf.numpy()).cast("B")
        out = torch.empty_like(buf)
        oview = memoryview(out.numpy()).cast("B")
        writes, reads = [], []
        for i in range(3):
            path = folder / f"probe{i}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                t0 = time.perf_counter()
                done = 0
                while done < nbytes:
                    done += os.pwrite(fd, view[done:], done)
                t1 = time.perf_counter()
                done = 0
                while done < nbytes:
                    n = os.preadv(fd, [oview[done:]], done)
                    if n <= 0:
                        break
                    done += n
                t2 = time.perf_counter()
            finally:
                os.close(fd)
                os.unlink(path)
            writes.append(nbytes / max(t1 - t0, 1e-9))
            reads.append(nbytes / max(t2 - t1, 1e-9))
        return sorted(writes)[1], sorted(reads)[1], str(folder.parent), nbytes  # medians of 3
    finally:
        cleanup.remove_dir(folder)


def _probe_copies(device: torch.device, nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    d2h, h2d = [], []
    with torch.cuda.stream(stream):
        for _ in range(3):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record(stream)
            host.copy_(dev, non_blocking=True)
            b.record(stream)
            dev.copy_(host, non_blocking=True)
            c.record(stream)
            c.synchronize()
            d2h.append(nbytes / (a.elapsed_time(b) / 1e3))
            h2d.append(nbytes / (b.elapsed_time(c) / 1e3))
    return sorted(d2h)[1], sorted(h2d)[1]


def probe_bandwidths(device: str | torch.device = "cpu", directory: str | None = None, *,
                     nbytes: int = _PROBE_BYTES) -> Bandwidths:
    """Measure now (no cache): about 0.1-0.5 s on a local disk."""
    device = torch.device(device)
    w, r, folder, nbytes = _probe_disk(directory, nbytes)
    d2h = h2d = None
    if device.type == "cuda":
        d2h, h2d = _probe_copies(device, nbytes)
    bw = Bandwidths(device=_device_key(device), disk_write_bytes_per_s=w, disk_read_bytes_per_s=r,
                    d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, directory=folder, probe_bytes=nbytes,
                    measured_at=time.time())
    logger.info("offload bandwidths: %s", bw)
    return bw


def load_bandwidths(device: str | torch.device = "cpu", directory: str | None = None, *,
                    cache_path: str | os.PathLike | None = None, refresh: bool = False) -> Bandwidths:
    """Cached figures for (device, filesystem of ``directory``), probing once when missing.

    ``directory`` defaults to MEMRT_OFFLOAD_DIR (the folder the disk tier will write to, so the planner
    prices the disk it will use), else the temp dir. A cache file or entry that is not valid (truncated
    JSON, a figure that is 0, negative, null or not a number) is ignored with one warning and measured again.
    """
    device = torch.device(device)
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    if directory is None:
        from memrt.config import load_config

        directory = load_config(warn_unknown=False).offload_dir
    if directory is not None and not Path(directory).is_dir():
        directory = None  # not created yet (or unusable: the folder check says why): the temp dir's filesystem
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    key = f"{_device_key(device)}|{_fs_key(folder)}"
    cache = _read_cache(path)
    if not refresh and key in cache:
        try:
            return Bandwidths.from_dict(cache[key])
        except ValueError as exc:
            logger.warning("memrt: ignoring the offload bandwidth cache entry for %s in %s (%s); measuring again",
                           key, path, exc)
    try:
        bw = probe_bandwidths(device, directory)
    except (OSError, OffloadError) as exc:  # the folder check has warned already: price the temp dir's disk
        if directory is None:
            raise
        logger.debug("bandwidth probe in %s failed (%s); probing the temp dir", directory, exc)
        return load_bandwidths(device, tempfile.gettempdir(), cache_path=path, refresh=refresh)
    cache[key] = asdict(bw)
    _write_cache(path, cache)
    return bw


def _read_cache(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("memrt: cannot read the offload bandwidth cache %s (%s); measuring again", path, exc)
        return {}
    try:
        cache = json.loads(text)
    except ValueError as exc:
        cache = exc
    if not isinstance(cache, dict):
        why = cache if isinstance(cache, ValueError) else f"expected an object, got {type(cache).__name__}"
        logger.warning("memrt: ignoring the offload bandwidth cache %s (%s); measuring again", path, why)
        return {}
    return cache


def _write_cache(path: Path, cache: dict) -> None:
    """Write the cache privately: folders this creates 0700, the file 0600."""
    from memrt.profiling.recorder import make_private_dir

    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        make_private_dir(path.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("could not cache offload bandwidths in %s (%s); they will be probed again", path, exc)
