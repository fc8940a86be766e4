"""memrt.comm's process state and its set-up: rendezvous, topology discovery, tier groups, teardown.

:func:`init_process_group` finds the launcher (torchrun, mpiexec, srun) and joins the default group;
:func:`setup_topology` then discovers the nodes, creates and warms the tier groups, and starts the health
monitor. All of it lands in :data:`STATE`, which the collectives (:mod:`memrt.comm.dispatch`,
:mod:`memrt.comm.api`) read; :func:`ensure` sets up lazily for a job whose group was made by torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch.distributed as tdist

from memrt.agreement import check_or_exit as check_settings_agree
from memrt.comm import events, streams
from memrt.comm.health import HealthMonitor
from memrt.comm.measured_pick import MeasuredPicks
from memrt.comm.tiers import HierGroups, clear_group_cache, torch_groups
from memrt.comm.topology import Topology, discover
from memrt.config import MemrtConfig, load_config

__all__ = ["STATE", "CommState", "comm_mode", "destroy_process_group", "ensure", "get_topology", "init_process_group",
           "let_backend_threads_finish", "override", "prepare", "set_checks", "settings", "setup_topology",
           "use_collectives"]


@dataclass(slots=True)
class CommState:
    """What memrt.comm knows about this job once it is set up: one per process, :data:`STATE`."""

    topology: Topology | None = None
    groups: HierGroups | None = None
    """The tier groups (intra-node, inter-node) when the hierarchical algorithms can run."""
    mpi: Any = None
    """memrt's MPI backend (``backend="mpi"`` without torch's own MPI build)."""
    config: MemrtConfig | None = None
    """The settings memrt.comm runs with (given at init, or read at the lazy set-up)."""
    health: HealthMonitor | None = None
    check_group: Any = None
    """The gloo group of the cross-rank argument check (debug)."""
    checks: bool = False
    executor: cf.ThreadPoolExecutor | None = None
    """The one comm thread memrt's own algorithms run on, in call order."""
    deferred: dict | None = None
    """set-up's arguments while discovery waits for the first memrt collective (NCCL: after set_device)."""
    warmed: list = field(default_factory=list)
    """Member ranks of each group warmed at set-up, in order."""
    picks: MeasuredPicks = field(default_factory=MeasuredPicks)
    """all_gather / broadcast algorithms picked by timing where the cost model's predictions tie."""


STATE = CommState()

_COLLECTIVES: list[Any] = [None]
_SETUPS = [0]


def use_collectives(module: Any) -> None:
    """The collectives the link probe times each algorithm with (:mod:`memrt.comm.api` registers itself when it
    is imported: the set-up sits below the API it serves)."""
    _COLLECTIVES[0] = module


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None, *, intra_backend: str | None = None,
                       health: bool = True, config: MemrtConfig | None = None) -> None:
    """torch.distributed.init_process_group, plus launcher discovery and topology discovery.

    With no arguments it works under torchrun, mpiexec/mpirun (rendezvous over mpi4py when
    MASTER_ADDR is unset) and srun. ``backend="mpi"`` without torch's own MPI build runs memrt's MPI
    backend (mpi4py) for CPU collectives, over a gloo group for everything else.
    ``intra_backend="mpi"`` uses MPI for the intra-node tier only. On NCCL, discovery (an object
    collective on a CUDA device) waits for the first memrt collective or :func:`prepare`, i.e. after the
    script's ``torch.cuda.set_device``; elsewhere it runs here. ``config`` (default: the ``MEMRT_*``
    environment, read here once) is what every rank checks against the others and what memrt.comm runs with.
    """
    from memrt.launcher import discover_launch, master_address

    mpi_job = backend == "mpi" and not tdist.is_mpi_available()
    if intra_backend not in (None, "mpi", "torch"):
        raise ValueError(f"intra_backend={intra_backend!r} is not valid: expected None, 'torch' or 'mpi'")
    if init_method is None and store is None:
        launch = discover_launch()
        if launch.launcher != "single" and world_size < 0:
            world_size, rank = launch.world_size, launch.rank
        found = master_address(launch)
        if found is not None:
            init_method = f"tcp://{found[0]}:{found[1]}"
            if launch.launcher == "single":
                world_size, rank = 1, 0
    tdist.init_process_group(backend="gloo" if mpi_job else backend, init_method=init_method, timeout=timeout,
                             world_size=world_size, rank=rank, store=store, group_name=group_name,
                             pg_options=pg_options, device_id=device_id)
    # before the first collective: ranks with different MEMRT_* settings exit 2
    config = check_settings_agree(config)
    if streams.is_nccl() and not mpi_job:
        STATE.deferred = dict(mpi_job=mpi_job, intra_backend=intra_backend, health=health, device_id=device_id,
                              config=config)
        return
    setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health, config=config)


def setup_topology(*, mpi_job: bool = False, intra_backend: str | None = None, health: bool = True,
                   device: Any = None, device_id: Any = None, config: MemrtConfig | None = None) -> Topology:
    """Discover the topology, create the groups and warm them (collective; init_process_group calls it).

    ``config``: the settings memrt.comm runs with (default: the ``MEMRT_*`` environment, read here once, for
    a job whose process group is torch's own).

    On NCCL every set-up collective runs on :func:`memrt.comm.streams.setup_device` (``device``, a
    collective's tensor device, first): never on cuda:0 of every rank.
    """
    from memrt.comm.routing import internal_groups

    dev = streams.setup_device(device, device_id=device_id)
    with streams.on_device(dev), internal_groups():  # under the memrt process group, tier groups are plain gloo / NCCL
        return _setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health, device=dev,
                               config=config if config is not None else load_config(warn_unknown=False))


def _setup_topology(*, mpi_job: bool, intra_backend: str | None, health: bool, device: Any,
                    config: MemrtConfig) -> Topology:
    STATE.deferred = None
    STATE.config = config
    _SETUPS[0] += 1  # the same count on every rank: a fresh key space in the store for this set-up's picks
    STATE.picks = MeasuredPicks(generation=_SETUPS[0])
    topo = discover(override=config.topology)
    STATE.topology = topo
    if topo.hierarchical_useful or STATE.config.comm == "hier":
        if intra_backend == "mpi":
            from memrt.comm.mpi_backend import mixed_groups

            STATE.groups = mixed_groups(topo)
        else:
            STATE.groups = torch_groups(topo)
        # every communicator created now, once, in one order on every rank (not lazily mid-backward)
        STATE.warmed = streams.warm_groups(STATE.groups, device)
    if mpi_job:
        from memrt.comm.mpi_backend import MPIBackend

        STATE.mpi = MPIBackend(topology=topo)
    set_checks(config.debug)
    if health and topo.world_size > 1 and STATE.health is None:
        store = tdist.distributed_c10d._get_default_store()
        STATE.health = HealthMonitor(store, topo.rank, topo.world_size).start()
    if STATE.executor is None:
        STATE.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrt-comm")
    if topo.hierarchical_useful and STATE.config.comm != "off" and not mpi_job:
        from memrt.comm.probe import attach_links  # measured links (cached per topology)

        topo = STATE.topology = attach_links(topo, groups=STATE.groups, cache_dir=config.measurement_dir,
                                             collectives=_COLLECTIVES[0])
    return topo


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank argument check on or off (collective: call on every rank)."""
    if enabled and STATE.check_group is None:
        STATE.check_group = tdist.new_group(backend="gloo")
    STATE.checks = enabled


@contextlib.contextmanager
def comm_mode(mode: str):
    """Calls inside ``with comm_mode(mode):`` choose as under ``MEMRT_COMM=mode`` (auto, flat, hier or off),
    e.g. to time one algorithm against another in one process. Every rank must enter it around the same
    calls (the choice must agree across ranks). Needs memrt.comm's process group (groups are made at init)."""
    with override(comm=mode):  # an unknown mode: ConfigError naming MEMRT_COMM
        yield


def destroy_process_group(group: Any = None) -> None:
    world = group is None or group is tdist.GroupMember.WORLD
    if world:
        if STATE.executor is not None:
            STATE.executor.shutdown(wait=True)
        if STATE.health is not None:
            STATE.health.stop()
        if STATE.mpi is not None:
            STATE.mpi.close()
        clear_group_cache()
        STATE.__init__()
    tdist.destroy_process_group(group)
    if world:
        let_backend_threads_finish()


def let_backend_threads_finish(seconds: float = 0.05) -> None:
    """Hold no GIL for ``seconds``, so that the backend's worker threads free the tensors of finished
    collectives now.

    gloo frees a finished collective on its worker thread, which takes the GIL to release the tensors'
    Python objects. A worker still waiting for the GIL when the interpreter shuts down is ended by
    CPython, and torch (2.13) aborts the process on it ("terminate called without an active exception"),
    after the job's own work is done. A job calls this last, before it exits.
    """
    time.sleep(seconds)


def get_topology() -> Topology:
    """This job's :class:`Topology` (discovered at init; collective the first time if init was torch's own
    or the backend is NCCL)."""
    ensure()
    return STATE.topology


def prepare(device: Any = None, *, config: MemrtConfig | None = None) -> Topology:
    """Discovery, groups and their warm-up now, on ``device`` (collective; e.g. before DDP's first backward:
    a comm hook's first call then creates no communicator mid-backward). Idempotent. ``config``: the settings
    to set up with when not set up yet (default: those given to init_process_group, else the environment's)."""
    ensure(device, config=config)
    return STATE.topology


def settings(device: Any = None) -> Any:
    """The :class:`memrt.config.MemrtConfig` memrt.comm runs with (read once, when it set up on ``device``)."""
    ensure(device)
    return STATE.config


def ensure(device: Any = None, *, config: MemrtConfig | None = None) -> None:
    """Set memrt.comm up now when it is not (collective: the first memrt collective of every rank)."""
    if STATE.topology is None:
        if not tdist.is_initialized():
            raise RuntimeError("memrt.comm: the default process group is not initialized: call "
                               "memrt.comm.init_process_group() first")
        kwargs = dict(STATE.deferred or {})
        if config is not None:
            kwargs["config"] = config
        with events.quiet():  # discovery's collectives are memrt's, not the user's
            setup_topology(device=device, **kwargs)


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[Any]:
    """Calls inside ``with override(comm=..., compress=...):`` run with those settings in place of the ones
    read at set-up (collective in effect: every rank must enter it around the same calls). Yields the config."""
    ensure()
    saved = STATE.config
    STATE.config = dataclasses.replace(saved, **fields)
    try:
        yield STATE.config
    finally:
        STATE.config = saved
