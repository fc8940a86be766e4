"""One activated training process: settings, run id, failure policy, and what it did (for the report).

The session begins right after the job's ``init_process_group`` (or at the first DDP / ``fully_shard``
when the process group came from elsewhere). Everything here runs in the training process only, once.

Failure policy: a memrt failure prints ONE warning and the process carries on as if memrt were off
(:func:`fail`); ``MEMRT_STRICT=1`` raises instead. A setting memrt cannot parse (``MEMRT_BUDGET=lots``)
is the user's error, not memrt's: the rank that has it prints it and exits with status 2 before any
rendezvous (:func:`load_config_or_exit`); settings that must be the same on every rank are compared
right after the rendezvous (:mod:`memrt.agreement`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memrt.config import MemrtConfig, internal_setting, load_config
from memrt.errors import ConfigError, MemrtError
from memrt.exits import hard_exit
from memrt.launcher import LaunchInfo, discover_launch

__all__ = ["Session", "current", "fail", "load_config_or_exit", "remember_launch", "launch_info", "is_off",
           "ActivationError"]

logger = logging.getLogger("memrt.activation")

_LAUNCH: LaunchInfo | None = None
_SESSION: "Session | None" = None
_OFF = False
_WARNED = False


class ActivationError(MemrtError):
    """Raised instead of warning-and-continuing when MEMRT_STRICT=1."""


@dataclass(kw_only=True)
class Session:
    """What this activated process is and what memrt did in it."""

    config: MemrtConfig
    """Effective settings (MEMRT_*), with their sources."""
    launch: LaunchInfo
    """The launcher's description of this process (read before memrt filled in torchrun variables)."""
    rank: int
    """Global rank in the default process group."""
    world_size: int
    """Ranks in the default process group."""
    run_id: str
    """Shared by every rank of the job (agreed over the process group's store)."""
    report_dir: Path
    """Where this rank's ``rank{N}.json`` goes at exit."""
    nodes: tuple[tuple[int, ...], ...] | None = None
    """Global ranks per node when known (MEMRT_TOPOLOGY, memrt.comm discovery or the launcher's shape)."""
    nodes_source: str = "unknown"
    """Where ``nodes`` came from."""
    backend: str = ""
    """The default process group's backend (gloo, nccl, ...)."""
    pid: int = field(default_factory=os.getpid)
    """The process that owns the session: forked children never act on it."""
    started_s: float = field(default_factory=time.perf_counter)
    """perf_counter() when the session began."""
    models: list[dict[str, Any]] = field(default_factory=list)
    """One entry per DDP / FSDP2 module (or, in a single process, per trained model) memrt set up: type,
    parameters, budget, plan."""
    tracked: list[Any] = field(default_factory=list)
    """Weak references to the planned modules (to read their final plans at exit)."""
    comm_hooks: int = 0
    """DDP models whose gradient all-reduce goes through memrt.comm."""
    failures: list[str] = field(default_factory=list)
    """memrt failures in this process (each made memrt step aside)."""
    store: Any = None
    """A PrefixStore over the default process group's store (no device collectives)."""
    ddp_count: int = 0
    """DDP constructions seen (for per-model store keys)."""
    report_problem: str | None = None
    """Why no report can be written (the default folder is not writable), found at start; None when it can."""
    balance: Any = None
    """The :class:`memrt.balance.auto.Controller` (MEMRT_BALANCE auto|on, more than one rank), else None."""
    gc_frozen: dict[str, Any] | None = None
    """What :mod:`memrt.activation.collector` froze (objects, seconds) or why it did not (skipped); None before."""
    single: bool = False
    """True for a process without a process group, whose models memrt found through their optimizers
    (:mod:`memrt.activation.single`); False for a rank of a distributed job."""
    plans_of: Callable[[], list[dict[str, Any]]] | None = None
    """Where the report reads the models' plans at exit when the session keeps them itself (a single-process
    job's model is often gone by exit); None: the plans of the modules in ``tracked``."""
    summary_lines: Callable[["Session"], list[str]] | None = None
    """Extra lines for the exit summary (a single-process job's per-model plan lines), or None."""
    clock: Any = None
    """The :class:`memrt.activation.steptime.StepClock` of this rank's steps (from the session's start)."""
    sync_waiting: list[Any] = field(default_factory=list)
    """``(weakref to a DDP model, its report entry)`` under ``MEMRT_SYNC=diloco`` on several nodes, until the
    optimizer that trains it is built (:func:`memrt.activation.wiring.note_optimizer`)."""
    syncs: list[Any] = field(default_factory=list)
    """The :class:`memrt.sync.DiLoCo` of each such model once its optimizer exists."""
    fits: dict[str, Any] = field(default_factory=dict)
    """Device -> its fit-the-device budget (:class:`memrt.memory.fit.DeviceFit`, None on a CPU) when MEMRT_BUDGET
    is unset: measured when memrt attaches to the first model on that device (:mod:`memrt.activation.budget`)."""


def remember_launch(launch: LaunchInfo) -> None:
    """Keep the launcher's own description before memrt adds torchrun variables for MPI launches."""
    global _LAUNCH
    _LAUNCH = launch


def launch_info() -> LaunchInfo:
    return _LAUNCH if _LAUNCH is not None else discover_launch()


def current() -> Session | None:
    """This process's session, or None (not begun, or owned by the parent of a forked child)."""
    if _SESSION is not None and _SESSION.pid == os.getpid():
        return _SESSION
    return None


def set_current(session: Session) -> None:
    global _SESSION
    _SESSION = session


def is_off() -> bool:
    """True when memrt stepped aside in this process (after a failure), or in a forked child."""
    return _OFF or (_SESSION is not None and _SESSION.pid != os.getpid())


def _strict() -> bool:
    sess = current()
    if sess is not None:
        return sess.config.strict
    try:  # before the session (a start-up failure): the environment's setting
        return load_config(warn_unknown=False).strict
    except ConfigError:
        return False


def fail(what: str, exc: BaseException) -> None:
    """A memrt failure: one warning and memrt steps aside in this process, or raise under MEMRT_STRICT=1."""
    global _OFF, _WARNED
    if _strict():
        if what == "start-up":  # an exception cannot leave a .pth line: say it and stop like a failed import
            sys.stderr.write(f"memrt: error: {what} failed: {type(exc).__name__}: {exc} (MEMRT_STRICT=1)\n")
            sys.stderr.flush()
            hard_exit(2)
        raise ActivationError(f"memrt {what} failed (MEMRT_STRICT=1): {type(exc).__name__}: {exc}") from exc
    _OFF = True
    session = current()
    if session is not None:
        session.failures.append(f"{what}: {type(exc).__name__}: {exc}")
        _undo_plans(session)
    logger.debug("memrt %s failed", what, exc_info=exc)
    if not _WARNED:
        _WARNED = True
        rank = session.rank if session is not None else launch_info_safe().rank
        logger.warning("memrt: %s failed on rank %d (%s: %s); continuing without memrt "
                       "(MEMRT_STRICT=1 makes this an error)", what, rank, type(exc).__name__, exc)


def _undo_plans(session: Session) -> None:
    """Remove memrt's memory hooks from every model (memrt.disable): training goes on as without memrt."""
    if not session.tracked:
        return
    from memrt import disable

    for ref in session.tracked:
        module = ref()
        if module is None:
            continue
        try:
            disable(module)
        except Exception:  # noqa: BLE001 - best effort: the warning below is what the user sees
            logger.debug("memrt.disable failed", exc_info=True)


def launch_info_safe() -> LaunchInfo:
    try:
        return launch_info()
    except ConfigError:
        return LaunchInfo(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1)


def load_config_or_exit() -> MemrtConfig:
    """The effective settings, checked on this machine (:mod:`memrt.activation.checks`).

    A bad one is the user's error: the rank that has it prints it (one line, naming the rank in a job) and
    exits 2, before any rendezvous, so no rank waits for it. Its peers, waiting in the rendezvous, are stopped
    by the launcher (torchrun, mpiexec).
    """
    launch = launch_info_safe()
    try:
        config = load_config()
        from memrt.activation.checks import startup_errors

        errors = startup_errors(config, launch.local_rank)
        if errors:
            raise errors[0]
    except ConfigError as exc:
        where = f" (rank {launch.rank})" if launch.world_size > 1 else ""
        sys.stderr.write(f"memrt: error: {exc}{where}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    logging.getLogger("memrt").setLevel(config.log_level.upper())
    return config


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxxxx``: sortable, unique enough for one machine's report folder."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def agree_run_id(store: Any, rank: int, *, timeout_s: float = 60.0) -> str:
    """Rank 0 picks the run id (MEMRT_RUN_ID when memrt run / demo set one) and the others read it."""
    from datetime import timedelta

    if store is None:
        return internal_setting("MEMRT_RUN_ID") or new_run_id()
    if rank == 0:
        run_id = internal_setting("MEMRT_RUN_ID") or new_run_id()
        store.set("run_id", run_id)
        return run_id
    store.wait(["run_id"], timedelta(seconds=timeout_s))
    return store.get("run_id").decode()


def report_dir_for(config: MemrtConfig, run_id: str) -> Path:
    """MEMRT_REPORT_DIR as given, else ./memrt-report/<run id>/."""
    if config.report_dir:
        return Path(config.report_dir)
    return Path.cwd() / "memrt-report" / run_id
