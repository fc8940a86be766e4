"""The disk tier's folder, checked when a plan is made, before any step writes to it.

:func:`usable_tiers` decides which offload tiers the planner may use on this rank, :func:`room_for` whether
the plan made with the disk tier fits:

- ``host`` needs a CUDA device: asked for explicitly (``MEMRT_OFFLOAD=host``) on a CPU-only process it is a
  warning naming the setting, and planning goes on with keep/recompute;
- ``disk`` needs a folder (``MEMRT_OFFLOAD_DIR``, else the temp dir) that exists or can be created (each
  level memrt creates is 0700, removed at exit when empty) and that this process can write; and the plan
  needs room on its filesystem for what it writes per step, for every process sharing the folder, plus
  :data:`MARGIN`. Processes sharing a folder see each other through small reservation files
  (``memrt-reserve-<host>-<pid>``, 0600, removed at exit; those of dead processes on this host are swept):
  the last of two ranks to check counts both, so two ranks on one small filesystem never each pass alone
  and then fill it mid-step. (Ranks using different folders of one filesystem do not see each other.)

A folder that fails is one warning per rank (naming the setting, the folder and the reason) and the plan is
made again without the disk tier; ``MEMRT_STRICT=1`` makes it an error: the message, exit status 2. Each such
fallback is noted with :func:`memrt.errors.note_degraded`, so the run summary does not count it as clean.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from memrt.memory.offload import cleanup

if TYPE_CHECKING:
    import torch

    from memrt.config import MemrtConfig
    from memrt.memory.planner import Plan
    from memrt.memory.profile import Profile

__all__ = ["MARGIN", "FolderCheck", "check_folder", "usable_tiers", "room_for", "room_left", "sweep_stale_reservations"]

logger = logging.getLogger(__name__)

MARGIN = 0.25
"""Free space asked beyond the bytes the plans of every process sharing the folder may write."""
_RESERVE = "memrt-reserve-"
_OTHER_HOST_MAX_AGE_S = 24 * 3600.0
"""Reservations of processes on other hosts (shared filesystems) count while younger than this."""
_checked: dict[str, "FolderCheck"] = {}
_warned: set[str] = set()


@dataclass(kw_only=True, slots=True)
class FolderCheck:
    """Whether the disk tier can use a folder for a plan of ``need_bytes``."""

    folder: str
    """The folder checked (MEMRT_OFFLOAD_DIR, else the temp dir)."""
    need_bytes: int
    """Bytes this process's plan may write per step."""
    shared_bytes: int = 0
    """Bytes reserved by every live process using the folder, this one included."""
    sharers: int = 1
    """Processes with a live reservation in the folder, this one included."""
    free_bytes: int | None = None
    """Free space of the folder's filesystem when checked."""
    problem: str | None = None
    """Why the folder cannot be used; None when it can."""


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def room_left(folder: str | os.PathLike) -> int:
    """Free bytes of ``folder``'s filesystem not reserved by other live processes (0 when unknown)."""
    import shutil

    folder = Path(folder)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return 0
    reserved, _ = _reservations(folder)
    try:
        mine = int((folder / f"{_RESERVE}{_host()}-{os.getpid()}").read_text().strip())
    except (OSError, ValueError):
        mine = 0
    return max(0, free - (reserved - mine))


def sweep_stale_reservations(folder: Path) -> None:
    """Remove reservation files of dead processes of this host in ``folder``."""
    _reservations(folder)


def _reservations(folder: Path) -> tuple[int, int]:
    """(bytes, processes) reserved in ``folder`` by live processes; sweeps dead ones of this host."""
    host, now = _host(), time.time()
    total = count = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, 0
    for name in names:
        if not name.startswith(_RESERVE):
            continue
        path = folder / name
        owner_host, _, pid = name[len(_RESERVE):].rpartition("-")
        try:
            if owner_host == host:
                if not pid.isdigit() or not cleanup.pid_alive(int(pid)):
                    path.unlink(missing_ok=True)
                    continue
            elif now - path.stat().st_mtime > _OTHER_HOST_MAX_AGE_S:
                continue
            value = path.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total += int(value)
            count += 1
    return total, count


def _reserve(folder: Path, nbytes: int) -> Path:
    path = folder / f"{_RESERVE}{_host()}-{os.getpid()}"
    tmp = folder / f".{path.name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(str(int(nbytes)))
    os.replace(tmp, path)
    cleanup.register_file(path)
    return path


def check_folder(parent: str | os.PathLike | None, need_bytes: int, *, margin: float = MARGIN) -> FolderCheck:
    """Check (and reserve room in) the disk tier's folder for a plan writing up to ``need_bytes`` per step."""
    from memrt.sizes import format_bytes

    folder = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    check = FolderCheck(folder=str(folder), need_bytes=int(need_bytes))
    if folder.exists() and not folder.is_dir():
        check.problem = f"{folder} is not a directory"
        return check
    try:
        cleanup.make_folder_chain(folder)
    except OSError as exc:
        check.problem = f"{folder} cannot be created ({exc.strerror or exc})"
        return check
    cleanup.sweep_stale_dirs(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".memrt-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        check.problem = f"cannot write in {folder} ({exc.strerror or exc})"
        return check
    if need_bytes <= 0:
        return check
    try:
        mine = _reserve(folder, need_bytes)
    except OSError as exc:
        check.problem = f"cannot write in {folder} ({exc.strerror or exc})"
        return check
    import shutil

    check.shared_bytes, check.sharers = _reservations(folder)
    check.free_bytes = shutil.disk_usage(folder).free
    want = int(check.shared_bytes * (1.0 + margin))
    if check.free_bytes < want:
        mine.unlink(missing_ok=True)
        cleanup.forget_file(mine)
        others = f" by the {check.sharers} processes sharing it" if check.sharers > 1 else ""
        check.problem = (f"{folder} has {format_bytes(check.free_bytes)} free, but the plan may write up to "
                         f"{format_bytes(need_bytes)} per step here ({format_bytes(check.shared_bytes)}{others}, "
                         f"+{margin:.0%} margin)")
    return check


def usable_tiers(profile: Profile, offload: str | None, device: str | torch.device,
                 config: MemrtConfig | None = None) -> tuple[str, ...]:
    """The offload tiers the planner may use for ``profile`` with ``MEMRT_OFFLOAD=offload`` on ``device``.

    The disk tier needs a folder that exists or can be created and that this process can write; whether
    it has room is decided for the plan made with it (:func:`room_for`). ``config``: the settings naming the
    folder (``offload_dir``) and ``strict`` (default: the environment's)."""
    import torch

    if offload in (None, "none"):
        return ()
    cuda = torch.device(device).type == "cuda"
    tiers: Sequence[str] = ("disk", "host") if offload == "auto" else (offload,)
    if "host" in tiers and not cuda:
        if offload == "host":
            _warn_once("host", f"MEMRT_OFFLOAD=host: the host tier needs a CUDA device and this process plans for "
                               f"{device}; planning without offloading (keep / recompute)")
        tiers = tuple(t for t in tiers if t != "host")
    if "disk" in tiers and _verdict(0, config).problem is not None:
        tiers = tuple(t for t in tiers if t != "disk")
    return tuple(tiers)


def room_for(plan: Plan, config: MemrtConfig | None = None) -> bool:
    """Whether the disk tier's folder has room for ``plan`` (and every other plan sharing it); reserves it.

    False after one warning when it has not: the disk tier is then left out of this process's plans
    (:func:`usable_tiers`) and the caller plans again."""
    from memrt.memory.offload.engine import plan_bytes

    need = plan_bytes(plan, "disk")
    return need == 0 or _verdict(need, config).problem is None


def _verdict(need: int, config: MemrtConfig | None = None) -> FolderCheck:
    """The folder's check for a plan writing ``need`` bytes (0: usable at all), warned once when it fails."""
    if config is None:  # called on its own: the environment's settings
        from memrt.config import load_config

        config = load_config(warn_unknown=False)
    key = str(config.offload_dir)
    check = _checked.get(key)
    if check is None or (check.problem is None and need > check.need_bytes):
        check = _checked[key] = check_folder(config.offload_dir, need)
    if check.problem is not None:
        setting = f"MEMRT_OFFLOAD_DIR={config.offload_dir}" if config.offload_dir else \
            "the offload folder (MEMRT_OFFLOAD_DIR unset: the temp dir)"
        message = f"{setting} cannot take offloaded activations{_on_rank()}: {check.problem}"
        if config.strict:
            sys.stderr.write(f"memrt: error: {message} (MEMRT_STRICT=1)\n")
            sys.stderr.flush()
            raise SystemExit(2)
        _warn_once(f"disk:{key}", f"{message}; planning without the disk tier (set MEMRT_OFFLOAD_DIR to a "
                                  "writable folder with room, or MEMRT_OFFLOAD=none; MEMRT_STRICT=1 makes this "
                                  "an error)")
    return check


def _on_rank() -> str:
    try:
        from memrt.launcher import discover_launch

        launch = discover_launch()
        return f" on rank {launch.rank}" if launch.world_size > 1 else ""
    except Exception:  # noqa: BLE001 - the rank only decorates the message
        return ""


def _warn_once(key: str, message: str) -> None:
    from memrt.errors import note_degraded

    if key in _warned:
        return
    _warned.add(key)
    note_degraded(message)
    logger.warning("memrt: %s", message)


def reset() -> None:
    """Forget earlier verdicts and warnings (tests)."""
    _checked.clear()
    _warned.clear()
