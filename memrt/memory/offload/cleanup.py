"""Removal of offload files on normal exit, on exceptions and on SIGTERM.

Every disk-tier directory memrt creates is registered here. They are removed by the owner's
``close()``, by an ``atexit`` hook (normal exit, uncaught exceptions) and by a SIGTERM handler
that removes them and then lets the signal do what it did before (the default: terminate).
A forked child (DataLoader worker) never removes its parent's directories: every action checks
the pid that registered the directory. Folder names carry the host and the pid
(``memrt-offload-<host>-<pid>-*``): those of processes of this host that died by SIGKILL are swept the
next time memrt creates a directory or checks a folder in the same parent (the temp dir included); a
folder of another host (a shared ``MEMRT_OFFLOAD_DIR``) is never touched, whatever its pid. Parent levels
memrt creates for a missing ``MEMRT_OFFLOAD_DIR`` chain are 0700 and removed at exit when left empty.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

from memrt.exits import on_hard_exit
from memrt.launcher import pid_alive

__all__ = ["make_private_dir", "make_folder_chain", "register_dir", "register_file", "forget_file", "remove_dir",
           "sweep_stale_dirs", "pid_alive"]

logger = logging.getLogger(__name__)

_PREFIX = "memrt-offload-"
_lock = threading.Lock()
_dirs: dict[str, int] = {}  # path -> pid that created it
_files: dict[str, int] = {}  # path -> pid that created it
_chain: dict[str, int] = {}  # folders in a chain memrt made (marked levels removed at exit) -> pid
_installed = False
_previous_sigterm = None


def _host() -> str:
    return socket.gethostname().replace("-", "_")


_MADE = ".memrt-made"
"""Marker file in each folder level memrt created: only marked levels are ever removed, by whichever process
of the job leaves last (a level a sibling rank created is removed once the sibling's files are gone too)."""


def make_folder_chain(folder: str | os.PathLike) -> None:
    """Create ``folder`` and its missing parents, each 0700 (not under the umask); removed at exit when empty."""
    from memrt.profiling.recorder import make_private_dir as make_private_levels

    folder = Path(folder)
    created: list[Path] = []
    try:
        make_private_levels(folder, created)  # a level another rank created a moment ago is not ours to mark
    finally:  # levels made before a failure deeper down are marked too, so they are removed at exit
        for level in created:
            os.close(os.open(level / _MADE, os.O_WRONLY | os.O_CREAT, 0o600))
    if (folder / _MADE).exists():
        with _lock:
            _chain[str(folder)] = os.getpid()
        _install_handlers()


def _remove_made_levels(folder: str) -> None:
    """From ``folder`` up: remove each level memrt made that holds nothing but its marker."""
    cur = Path(folder)
    while cur.parent != cur:
        try:
            if set(os.listdir(cur)) != {_MADE}:
                return
            os.unlink(cur / _MADE)
            os.rmdir(cur)
        except OSError:  # a sibling removed it first, or put something in meanwhile
            if cur.exists():
                return
        cur = cur.parent


def make_private_dir(parent: str | os.PathLike | None) -> Path:
    """A new directory (mode 0700) for this process's offload files, inside ``parent`` or the temp dir."""
    where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        make_folder_chain(where)
    except OSError as exc:
        from memrt.memory.offload.errors import OffloadError

        raise OffloadError(
            f"cannot create the offload directory {str(where)!r} ({exc}); set MEMRT_OFFLOAD_DIR to a "
            f"writable directory on a disk with free space, or MEMRT_OFFLOAD=none") from exc
    sweep_stale_dirs(where)
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{_host()}-{os.getpid()}-", dir=where))  # mkdtemp: 0700
    except OSError as exc:
        from memrt.memory.offload.errors import OffloadError

        raise OffloadError(
            f"cannot create a private directory in {str(where)!r} for offloaded activations ({exc}); set "
            f"MEMRT_OFFLOAD_DIR to a writable directory, or MEMRT_OFFLOAD=none") from exc
    register_dir(path)
    return path


def register_file(path: str | os.PathLike) -> None:
    """Remove the file ``path`` at exit and on SIGTERM unless forgotten before."""
    with _lock:
        _files[str(path)] = os.getpid()
    _install_handlers()


def forget_file(path: str | os.PathLike) -> None:
    with _lock:
        _files.pop(str(path), None)


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


def sweep_stale_dirs(parent: str | os.PathLike) -> int:
    """Remove ``memrt-offload-<this host>-<pid>-*`` folders in ``parent`` whose process is gone; return how many.

    Folders of other hosts (``parent`` on a shared filesystem) are left alone: their pids mean nothing here.
    """
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    mine = f"{_PREFIX}{_host()}-"
    for name in names:
        if not name.startswith(mine):
            continue
        pid_text = name[len(mine):].split("-", 1)[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        _rmtree(os.path.join(parent, name))
        removed += 1
    if removed:
        logger.info("removed %d stale offload folder(s) of dead processes in %s", removed, parent)
    return removed




def _rmtree(path: str) -> None:
    for _ in range(5):  # a file may appear while removing: retry a few times
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
    logger.warning("could not remove offload folder %s; remove it by hand", path)


def _remove_all_own() -> None:
    me = os.getpid()
    with _lock:
        mine = [p for p, pid in _dirs.items() if pid == me]
        for p in mine:
            _dirs.pop(p, None)
        files = [p for p, pid in _files.items() if pid == me]
        for p in files:
            _files.pop(p, None)
        levels = [p for p, pid in _chain.items() if pid == me]
        for p in levels:
            _chain.pop(p, None)
    for p in mine:
        _rmtree(p)
    for p in files:
        try:
            os.unlink(p)
        except OSError:
            pass
    for p in levels:  # a level someone else still uses is not empty and stays (the last to leave removes it)
        _remove_made_levels(p)


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
    on_hard_exit(_remove_all_own)  # os._exit skips atexit
    if threading.current_thread() is not threading.main_thread():
        logger.debug("offload directory registered off the main thread: no SIGTERM handler installed")
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is _on_sigterm:
        return
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
