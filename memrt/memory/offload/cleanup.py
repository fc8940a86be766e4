"""Removal of offload files on normal exit, on exceptions and on SIGTERM.

Every disk-tier directory memrt creates is registered here. They are removed by the owner's
``close()``, by an ``atexit`` hook (normal exit, uncaught exceptions) and by a SIGTERM handler
that removes them and then lets the signal do what it did before (the default: terminate).
A forked child (DataLoader worker) never removes its parent's directories: every action checks
the pid that registered the directory. Directories of processes that died by SIGKILL are swept
the next time memrt creates a directory in the same parent folder.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

__all__ = ["make_private_dir", "register_dir", "remove_dir", "registered_dirs", "sweep_stale_dirs"]

logger = logging.getLogger(__name__)

_PREFIX = "memrt-offload-"
_lock = threading.Lock()
_dirs: dict[str, int] = {}  # path -> pid that created it
_installed = False
_previous_sigterm = None


def make_private_dir(parent: str | os.PathLike | None) -> Path:
    """A new directory (mode 0700) for this process's offload files, inside ``parent`` or the temp dir."""
    if parent is not None:
        parent = Path(parent)
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from memrt.memory.offload.errors import OffloadError

            raise OffloadError(
                f"cannot create the offload directory {str(parent)!r} ({exc}); set MEMRT_OFFLOAD_DIR to a "
                f"writable directory on a disk with free space, or MEMRT_OFFLOAD=none") from exc
        sweep_stale_dirs(parent)
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))  # mkdtemp: mode 0700
    except OSError as exc:
        from memrt.memory.offload.errors import OffloadError

        where = str(parent) if parent is not None else tempfile.gettempdir()
        raise OffloadError(
            f"cannot create a private directory in {where!r} for offloaded activations ({exc}); set "
            f"MEMRT_OFFLOAD_DIR to a writable directory, or MEMRT_OFFLOAD=none") from exc
    register_dir(path)
    return path


def register_dir(path: str | os.PathLike) -> None:
    """Remove ``path`` (recursively) at exit and on SIGTERM unless removed before."""
    with _lock:
        _dirs[str(path)] = os.getpid()
    _install_handlers()


def remove_dir(path: str | os.PathLike) -> None:
    """Remove ``path`` now (if this process created it) and forget it."""
    key = str(path)
    with _lock:
        owner = _dirs.pop(key, None)
    if owner is None or owner == os.getpid():
        _rmtree(key)


def registered_dirs() -> list[str]:
    with _lock:
        return [p for p, pid in _dirs.items() if pid == os.getpid()]


def sweep_stale_dirs(parent: str | os.PathLike) -> int:
    """Remove ``memrt-offload-<pid>-*`` folders in ``parent`` whose process is gone; return how many."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        _rmtree(os.path.join(parent, name))
        removed += 1
    if removed:
        logger.info("removed %d stale offload folder(s) of dead processes in %s", removed, parent)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rmtree(path: str) -> None:
    for _ in range(5):  # a file may appear while removing: retry a few times
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
    logger.warning("could not remove offload folder %s; remove it by hand", path)


def _remove_all_own() -> None:
    with _lock:
        mine = [p for p, pid in _dirs.items() if pid == os.getpid()]
        for p in mine:
            _dirs.pop(p, None)
    for p in mine:
        _rmtree(p)


def _on_sigterm(signum, frame) -> None:
    _remove_all_own()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # default action: terminate with SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    global _installed, _previous_sigterm
    if _installed:
        return
    _installed = True
    atexit.register(_remove_all_own)
    if threading.current_thread() is not threading.main_thread():
        logger.debug("offload directory registered off the main thread: no SIGTERM handler installed")
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is _on_sigterm:
        return
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
