"""Checks of the settings that need this machine (devices, folders), run before the job's rendezvous.

:func:`memrt.config.load_config` checks each value's form; these check that the value can work here, so that
a run and ``memrt info`` accept and reject the same settings:

- ``MEMRT_BUDGET`` as an absolute size: at most :data:`memrt.config.MAX_BUDGET_FACTOR` x the capacity of the
  device memrt plans for (this rank's GPU when CUDA is available, else the machine's RAM);
- ``MEMRT_REPORT_DIR``: a folder memrt can create (or that exists) and write, checked without leaving
  anything behind; the default ``./memrt-report`` that cannot be written is a warning, not an error.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from memrt.config import MemrtConfig, budget_capacity_error
from memrt.errors import ConfigError

__all__ = ["planning_device", "budget_error", "folder_problem", "report_dir_error", "default_report_problem",
           "startup_errors", "sweep_leftovers"]


def planning_device(local_rank: int = 0) -> tuple[str, int | None]:
    """(name, capacity in bytes) of the device memrt plans memory for on this rank."""
    import torch

    from memrt.memory.meter import device_capacity_bytes

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        return f"{device} ({torch.cuda.get_device_name(device)})", device_capacity_bytes(device)
    return "this machine's RAM (cpu)", device_capacity_bytes(torch.device("cpu"))


def budget_error(config: MemrtConfig, local_rank: int = 0) -> ConfigError | None:
    """An absolute MEMRT_BUDGET far beyond this rank's device, else None."""
    if config.budget is None or config.budget.bytes is None:
        return None
    name, capacity = planning_device(local_rank)
    return budget_capacity_error(config.budget, capacity, name)


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why memrt could not create and write files in ``path``, or None. Leaves nothing behind."""
    target = Path(path).absolute()
    existing = target
    while not existing.exists():
        if existing.is_symlink():
            return f"{existing} is a broken symbolic link"
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".memrt-write-check-", dir=existing)
    except OSError as exc:
        return f"cannot create files in {existing} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return None


def report_dir_error(config: MemrtConfig) -> ConfigError | None:
    """An explicit MEMRT_REPORT_DIR memrt cannot write, else None."""
    if not config.report_dir:
        return None
    why = folder_problem(config.report_dir)
    if why is None:
        return None
    return ConfigError("MEMRT_REPORT_DIR", config.report_dir, f"a folder memrt can create and write, but {why}")


def default_report_problem(config: MemrtConfig) -> str | None:
    """Why the default report folder (``./memrt-report``) cannot be written, when MEMRT_REPORT_DIR is unset."""
    if config.report_dir:
        return None
    return folder_problem(Path.cwd() / "memrt-report")


def startup_errors(config: MemrtConfig, local_rank: int = 0) -> list[ConfigError]:
    """Every machine-dependent problem of ``config`` on this rank (empty when none)."""
    errors = [report_dir_error(config), budget_error(config, local_rank)]
    return [e for e in errors if e is not None]


def sweep_leftovers(config: MemrtConfig) -> None:
    """Remove what dead memrt processes of this host left (a SIGKILL runs no clean-up): offload folders and
    reservations in the temp dir and in MEMRT_OFFLOAD_DIR, shared-memory slabs. Other hosts' are kept."""
    import logging

    try:
        from memrt.memory.offload.cleanup import sweep_stale_dirs
        from memrt.memory.offload.folder import sweep_stale_reservations

        for parent in {tempfile.gettempdir(), config.offload_dir or tempfile.gettempdir()}:
            sweep_stale_dirs(parent)
            sweep_stale_reservations(Path(parent))
    except Exception:  # noqa: BLE001 - sweeping is a courtesy, never a reason to stop
        logging.getLogger(__name__).debug("sweeping offload leftovers failed", exc_info=True)
    try:
        from memrt.comm.shm import sweep_stale_slabs

        sweep_stale_slabs()
    except Exception:  # noqa: BLE001
        logging.getLogger(__name__).debug("sweeping shared-memory slabs failed", exc_info=True)
