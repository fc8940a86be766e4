"""The drop-in torch.distributed surface: same names and signatures, topology-aware where it helps.

Collectives on the default group go through memrt (choice of algorithm per call, a CommRecord per
call, peer-failure diagnosis); calls on other groups, and every name memrt does not define, go
straight to torch.distributed. memrt's own algorithms run on one worker thread in call order, so
``async_op=True`` returns a real waitable :class:`MemrtWork` and ordering across ranks is kept.

Algorithm choice, for every op: :func:`memrt.comm.select.choose` (``MEMRT_COMM=flat|hier`` forces,
``auto`` takes the cost model's fastest; hierarchical needs more than one node with some node of
several ranks). Profiler events: one per user call, named as the backend's (:mod:`memrt.comm.events`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as tdist

from memrt.agreement import check_or_exit as check_settings_agree
from memrt.comm import hierarchical as alg
from memrt.comm import events, fusion, streams
from memrt.comm.health import HealthMonitor, check_signatures, debug_mode
from memrt.comm.reduction import REDUCE_OPS, op_name
from memrt.comm.tiers import HierGroups, clear_group_cache, torch_groups
from memrt.comm.topology import Topology, discover

__all__ = ["init_process_group", "destroy_process_group", "get_topology", "setup_topology", "all_reduce",
           "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
           "reduce_scatter_single", "MemrtWork", "set_checks", "prepare", "comm_mode"]

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _State:
    topology: Topology | None = None
    groups: HierGroups | None = None
    mpi: Any = None
    config: Any = None
    health: HealthMonitor | None = None
    check_group: Any = None
    checks: bool = False
    executor: cf.ThreadPoolExecutor | None = None
    warned: set = field(default_factory=set)
    deferred: dict | None = None
    warmed: list = field(default_factory=list)
    """Member ranks of each group warmed at set-up, in order."""
    """set_up's arguments while discovery waits for the first memrt collective (NCCL: after set_device)."""


_st = _State()


# ---------------------------------------------------------------- init / teardown
def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None, *, intra_backend: str | None = None,
                       health: bool = True) -> None:
    """torch.distributed.init_process_group, plus launcher discovery and topology discovery.

    With no arguments it works under torchrun, mpiexec/mpirun (rendezvous over mpi4py when
    MASTER_ADDR is unset) and srun. ``backend="mpi"`` without torch's own MPI build runs memrt's MPI
    backend (mpi4py) for CPU collectives, over a gloo group for everything else.
    ``intra_backend="mpi"`` uses MPI for the intra-node tier only. On NCCL, discovery (an object
    collective on a CUDA device) waits for the first memrt collective or :func:`prepare`, i.e. after the
    script's ``torch.cuda.set_device``; elsewhere it runs here.
    """
    from memrt.config import environ
    from memrt.errors import ConfigError
    from memrt.launcher import discover_launch, mpi_rendezvous, slurm_master

    mpi_job = backend == "mpi" and not tdist.is_mpi_available()
    if intra_backend not in (None, "mpi", "torch"):
        raise ValueError(f"intra_backend={intra_backend!r} is not valid: expected None, 'torch' or 'mpi'")
    if init_method is None and store is None:
        launch = discover_launch()
        env = environ()
        if launch.launcher != "single" and world_size < 0:
            world_size, rank = launch.world_size, launch.rank
        if launch.launcher != "torchrun" and not env.get("MASTER_ADDR"):
            if launch.is_mpi or (launch.launcher == "slurm" and _mpi_matches(launch.world_size)):
                init_method = mpi_rendezvous()
            elif launch.launcher == "slurm":
                found = slurm_master(env)
                if found is None:
                    raise ConfigError("MASTER_ADDR", None, "the rendezvous host: srun did not set SLURM_*NODELIST "
                                                           "and SLURM_JOB_ID; export MASTER_ADDR and MASTER_PORT")
                init_method = f"tcp://{found[0]}:{found[1]}"
            else:
                from memrt.launcher import free_port

                init_method, world_size, rank = f"tcp://127.0.0.1:{free_port()}", 1, 0
    tdist.init_process_group(backend="gloo" if mpi_job else backend, init_method=init_method, timeout=timeout,
                             world_size=world_size, rank=rank, store=store, group_name=group_name,
                             pg_options=pg_options, device_id=device_id)
    check_settings_agree()  # before the first collective: ranks with different MEMRT_* settings exit 2
    if streams.is_nccl() and not mpi_job:
        _st.deferred = dict(mpi_job=mpi_job, intra_backend=intra_backend, health=health, device_id=device_id)
        return
    setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health)


def _mpi_matches(world: int) -> bool:
    try:
        from memrt.launcher import import_mpi4py

        return import_mpi4py().COMM_WORLD.Get_size() == world
    except Exception:  # noqa: BLE001 - no usable MPI under this srun
        return False


def setup_topology(*, mpi_job: bool = False, intra_backend: str | None = None, health: bool = True,
                   device: Any = None, device_id: Any = None) -> Topology:
    """Discover the topology, create the groups and warm them (collective; init_process_group calls it).

    On NCCL every set-up collective runs on :func:`memrt.comm.streams.setup_device` (``device``, a
    collective's tensor device, first): never on cuda:0 of every rank.
    """
    from memrt.comm.routing import internal_groups

    dev = streams.setup_device(device, device_id=device_id)
    with streams.on_device(dev), internal_groups():  # under the memrt process group, tier groups are plain gloo / NCCL
        return _setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health, device=dev)


def _setup_topology(*, mpi_job: bool, intra_backend: str | None, health: bool, device: Any) -> Topology:
    from memrt.config import load_config

    _st.deferred = None
    _st.config = load_config(warn_unknown=False)
    topo = discover()
    _st.topology = topo
    if topo.hierarchical_useful or _st.config.comm == "hier":
        if intra_backend == "mpi":
            from memrt.comm.mpi_backend import mixed_groups

            _st.groups = mixed_groups(topo)
        else:
            _st.groups = torch_groups(topo)
        # every communicator created now, once, in one order on every rank (not lazily mid-backward)
        _st.warmed = streams.warm_groups(_st.groups, device)
    if mpi_job:
        from memrt.comm.mpi_backend import MPIBackend

        _st.mpi = MPIBackend(topology=topo)
    set_checks(debug_mode())
    if health and topo.world_size > 1 and _st.health is None:
        store = tdist.distributed_c10d._get_default_store()
        _st.health = HealthMonitor(store, topo.rank, topo.world_size).start()
    if _st.executor is None:
        _st.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrt-comm")
    if topo.hierarchical_useful and _st.config.comm != "off" and not mpi_job:
        from memrt.comm.probe import attach_links  # measured links (cached per topology)

        topo = _st.topology = attach_links(topo, groups=_st.groups, collectives=sys.modules[__name__])
    return topo


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank argument check on or off (collective: call on every rank)."""
    if enabled and _st.check_group is None:
        _st.check_group = tdist.new_group(backend="gloo")
    _st.checks = enabled


@contextlib.contextmanager
def comm_mode(mode: str):
    """Calls inside ``with comm_mode(mode):`` choose as under ``MEMRT_COMM=mode`` (auto, flat, hier or off),
    e.g. to time one algorithm against another in one process. Every rank must enter it around the same
    calls (the choice must agree across ranks). Needs memrt.comm's process group (groups are made at init)."""
    _ensure()
    saved = _st.config
    _st.config = dataclasses.replace(saved, comm=mode)  # an unknown mode: ConfigError naming MEMRT_COMM
    try:
        yield
    finally:
        _st.config = saved


def destroy_process_group(group: Any = None) -> None:
    world = group is None or group is tdist.GroupMember.WORLD
    if world:
        if _st.executor is not None:
            _st.executor.shutdown(wait=True)
        if _st.health is not None:
            _st.health.stop()
        if _st.mpi is not None:
            _st.mpi.close()
        clear_group_cache()
        _st.__init__()
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
    _ensure()
    return _st.topology


def prepare(device: Any = None) -> Topology:
    """Discovery, groups and their warm-up now, on ``device`` (collective; e.g. before DDP's first backward:
    a comm hook's first call then creates no communicator mid-backward). Idempotent."""
    _ensure(device)
    return _st.topology


def settings(device: Any = None) -> Any:
    """The :class:`memrt.config.MemrtConfig` memrt.comm runs with (read once, when it set up on ``device``)."""
    _ensure(device)
    return _st.config


def _ensure(device: Any = None) -> None:
    if _st.topology is None:
        if not tdist.is_initialized():
            raise RuntimeError("memrt.comm: the default process group is not initialized: call "
                               "memrt.comm.init_process_group() first")
        with events.quiet():  # discovery's collectives are memrt's, not the user's
            setup_topology(device=device, **(_st.deferred or {}))


# ---------------------------------------------------------------- work objects
class MemrtWork:
    """What ``async_op=True`` returns for memrt's algorithms: ``wait()``, ``is_completed()``, ``get_future()``."""

    def __init__(self, fut: cf.Future, tensors: list[torch.Tensor]) -> None:
        self._fut = fut
        self._tensors = tensors
        self._tfut: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        self._fut.result(timeout=secs)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self._fut.exception() is None

    def exception(self) -> BaseException | None:
        return self._fut.exception() if self._fut.done() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        """A torch Future whose value is the list of output tensors (as torch's Work.get_future())."""
        if self._tfut is None:
            tfut: torch.futures.Future = torch.futures.Future()

            def done(f: cf.Future) -> None:
                exc = f.exception()
                tfut.set_exception(exc) if exc is not None else tfut.set_result(self._tensors)

            self._fut.add_done_callback(done)
            self._tfut = tfut
        return self._tfut


class _RecordedWork:
    """A torch Work that records its CommRecord when it completes, and diagnoses peer failures.

    The health watchdog sees the collective as in flight from its launch to its completion, whether the
    caller waits on it (``wait()``) or hands its future on (``get_future()``, as DDP's comm hook does): a
    frozen peer is reported, and a dead one named, on both paths.
    """

    def __init__(self, work: Any, finish: Callable[[], None], name: str) -> None:
        self._work, self._name = work, name
        self._pending: Callable[[], None] | None = finish
        self._lock = threading.Lock()
        self._chained: Any = None
        health = _st.health
        self._token = health.begin(name) if health is not None else None
        if self._token is not None:
            try:
                work.get_future().add_done_callback(lambda _f: health.end(self._token))
            except Exception:  # noqa: BLE001 - a Work without a future: wait() ends the span
                pass

    def _end(self) -> None:
        if self._token is not None and _st.health is not None:
            _st.health.end(self._token)

    def _finish_once(self) -> None:
        """Record the call once (it may be both waited on and completed through its future)."""
        with self._lock:
            finish, self._pending = self._pending, None
        if finish is not None:
            finish()

    def wait(self, *args: Any, **kw: Any) -> bool:
        try:
            ok = self._work.wait(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            self._end()
            _raise_diagnosed(self._name, exc)
        self._end()
        self._finish_once()
        return ok

    def get_future(self) -> Any:
        """The work's future, recorded on completion; a failure becomes the diagnosed PeerFailureError."""
        if self._chained is None:
            def after(fut: Any) -> Any:
                try:
                    value = fut.value()
                except Exception as exc:  # noqa: BLE001
                    _raise_diagnosed(self._name, exc)
                self._finish_once()
                return value

            self._chained = self._work.get_future().then(after)
        return self._chained

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _raise_diagnosed(name: str, exc: BaseException) -> None:
    from memrt.comm.health import CollectiveMismatchError, PeerFailureError

    if _st.health is None or isinstance(exc, (PeerFailureError, CollectiveMismatchError, TypeError, ValueError)):
        raise exc
    raise _st.health.diagnose(name, exc) from exc


# ---------------------------------------------------------------- recording and choice
def _record(op: str, t: torch.Tensor, nbytes: int, algorithm: str, start: float, tier: dict[str, int],
            predicted: float | None, redop: str = "", reason: str = "") -> None:
    """One CommRecord; its size is nccl-tests' (all_gather: the gathered output, ``nbytes`` x ranks)."""
    from memrt.profiling.recorder import CommRecord, get_recorder

    world = _world()
    get_recorder().record_comm(CommRecord(
        op=op, dtype=str(t.dtype).replace("torch.", ""), nbytes=int(nbytes) * (world if op == "all_gather" else 1),
        group_size=world, algorithm=algorithm, seconds=time.perf_counter() - start, tier_bytes=tier,
        predicted_seconds=predicted, start=start, redop=redop, reason=reason))


def _world() -> int:
    return _st.topology.world_size if _st.topology is not None else tdist.get_world_size()


def tier_bytes(op: str, algorithm: str, nbytes: int, topo: Topology, element_size: int = 4) -> dict[str, int]:
    """Bytes this rank sends per tier for one call: :func:`memrt.comm.select.tier_bytes` on ``topo``."""
    from memrt.comm.select import tier_bytes as _tier_bytes

    return _tier_bytes(algorithm, nbytes, tuple(tuple(n) for n in topo.nodes), topo.rank, element_size, op=op)


def _decide(op: str, nbytes: int, dtype: torch.dtype, reduce_op: Any = None, src: int = 0) -> tuple[str, float | None]:
    """(algorithm, predicted seconds) for one call: memrt.comm.select.choose, the cost model's pick."""
    cfg, topo = _st.config, _st.topology
    if cfg.comm == "off":
        return "off", None
    if not topo.hierarchical_useful or _st.groups is None:
        return "flat", None
    from memrt.comm.select import choose

    # compression is asked per call (the DDP hook under MEMRT_COMPRESS, compress=), never by the config alone
    d = choose(op, nbytes, dtype, topo, _exact_config(cfg), reduce_op=reduce_op, backend=str(tdist.get_backend()),
               src=src)
    logger.debug("%s %d B: %s (%s)", op, nbytes, d.algorithm, d.reason)
    return d.algorithm, d.predicted_seconds


_exact_cfg: list[Any] = [None, None]


def _exact_config(cfg: Any) -> Any:
    """``cfg`` with compress="none" (cached for the current config object)."""
    if getattr(cfg, "compress", "none") == "none":
        return cfg
    if _exact_cfg[0] is not cfg:
        import dataclasses

        _exact_cfg[:] = [cfg, dataclasses.replace(cfg, compress="none")]
    return _exact_cfg[1]


def _plug_for(algorithm: str, base_key: Any, flat_ptr: int) -> Callable | None:
    if "+" not in algorithm:
        return None
    codec = algorithm.split("+", 1)[1]
    from memrt.comm.compress import compressed_all_reduce, feedback_part  # compressed inter-node hop

    def inter(shard: torch.Tensor, group: Any) -> Any:
        # error feedback only for a caller's own gradient buffer (base_key from the DDP hook): per chunk of it
        key = None if base_key is None else feedback_part(base_key, shard.data_ptr() - flat_ptr, shard.numel())
        # async: the payload is on the wire when this returns, the pipeline's wait() decodes it, so the
        # helper thread encodes the next chunk while this one crosses the slow link
        return compressed_all_reduce(shard, group, codec, key, async_op=True)

    return inter


def _run(name: str, t: torch.Tensor, nbytes: int, algorithm: str, predicted: float | None, fn: Callable[[], Any],
         async_op: bool, outputs: list[torch.Tensor], redop: str = "", reason: str = "") -> MemrtWork | None:
    """Run memrt's own algorithm ``fn`` for the user's call on the comm thread (one profiler event of the
    backend's name with the user's input ``t``; ``fn``'s internal collectives run unprofiled there)."""
    start = time.perf_counter()
    tier = tier_bytes(name, algorithm, nbytes, _st.topology, t.element_size())
    sub = streams.DeviceSubmission(t)  # CUDA: the worker's device and stream; done = the GPU work is done
    event = events.begin(name, [t])

    def job() -> None:
        try:
            # quiet: a profiler that records every thread would otherwise show fn's sub-collectives
            if _st.health is not None:
                with _st.health.inside(name), events.quiet():
                    sub.run(fn)
            else:
                with events.quiet():
                    sub.run(fn)
        except Exception as exc:  # noqa: BLE001
            _raise_diagnosed(name, exc)
        finally:
            if event is not None:
                event.end(here=True)
        _record(name, t, nbytes, algorithm, start, tier, predicted, redop, reason)

    work = MemrtWork(_st.executor.submit(job), outputs)
    if async_op:
        return work
    work.wait()
    return None


def _flat_torch(name: str, t: torch.Tensor, nbytes: int, call: Callable[[], Any], async_op: bool,
                predicted: float | None = None, redop: str = "", reason: str = "") -> Any:
    start = time.perf_counter()
    tier = tier_bytes(name, "flat", nbytes, _st.topology, t.element_size())
    timer = _CudaTimer(t) if t.is_cuda else None  # CUDA: seconds and the watchdog follow completion

    def finish() -> None:
        if timer is None:
            _record(name, t, nbytes, "flat", start, tier, predicted, redop, reason)
        else:
            timer.finish(name, t, nbytes, start, tier, predicted, redop, reason)

    from memrt.comm.routing import passthrough

    try:  # passthrough: a memrt process group underneath runs this flat call as it is (no second routing)
        with (_st.health.inside(name) if _st.health is not None else _null()), passthrough():
            work = call()
    except Exception as exc:  # noqa: BLE001
        _raise_diagnosed(name, exc)
    if async_op:
        return _RecordedWork(work, finish, name)
    finish()
    return None


class _CudaTimer:
    """CUDA events around a flat torch collective: the record's seconds run to completion (read later, no
    host wait) and the hang watchdog watches the end event rather than the enqueue."""

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        self.start_ev = torch.cuda.Event(enable_timing=True)
        self.start_ev.record(torch.cuda.current_stream(self.device))

    def finish(self, name: str, t: torch.Tensor, nbytes: int, start: float, tier: dict[str, int],
               predicted: float | None, redop: str = "", reason: str = "") -> None:
        from memrt.profiling.recorder import CommRecord, get_recorder

        end_ev = torch.cuda.Event(enable_timing=True)
        end_ev.record(torch.cuda.current_stream(self.device))  # after the call (or wait): joined the comm stream
        if _st.health is not None and hasattr(_st.health, "track"):
            _st.health.track(name, end_ev)
        get_recorder().record_comm_pending(CommRecord(
            op=name, dtype=str(t.dtype).replace("torch.", ""),
            nbytes=int(nbytes) * (_world() if name == "all_gather" else 1), group_size=_world(),
            algorithm="flat", seconds=0.0, tier_bytes=tier, predicted_seconds=predicted, start=start, redop=redop,
            reason=reason), self.start_ev, end_ev)


def _check(op: str, tensor: torch.Tensor, group: Any, *, extra: int = 0) -> None:
    with events.quiet():  # the cross-rank argument check is memrt's collective, not the user's
        check_signatures(op, tensor, group, extra=extra)


class _null:
    def __enter__(self) -> None: ...

    def __exit__(self, *a: Any) -> None: ...


def _mine(group: Any) -> bool:
    return (group is None or group is tdist.GroupMember.WORLD) and tdist.is_initialized()


# ---------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: Any = tdist.ReduceOp.SUM, group: Any = None, async_op: bool = False, *,
               compress: str | None = None):
    """torch.distributed.all_reduce; hierarchical (pipelined) when the topology and size make it pay.

    Exact unless ``compress`` ("bf16", "fp16", "int8", or "auto": bf16 where the cost model predicts
    a gain of at least 10%) asks to compress the inter-node hop of this call; ``MEMRT_COMPRESS`` alone
    applies to gradient reductions (the DDP hook), never to a plain call. No error feedback here: a
    call's own result only (see :func:`memrt.comm.register_ddp_hook` for gradients).
    """
    if compress is not None:
        from memrt.comm.compress import check_compress

        check_compress(compress, "compress")
    elif _mine(group):  # back-to-back small async calls are coalesced
        fused = fusion.intercept(tensor, op, async_op)
        if fused is not None:
            return fused
    return _all_reduce(tensor, op, group, async_op, codec=compress)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool, *, key: Any = None,
                codec: str | None = None):
    """``codec``: compression of the inter hop asked by the caller (None/'none': exact); ``key``: the
    caller's gradient buffer (a compress.FeedbackKey) for error feedback, None for none."""
    if not _mine(group):
        return tdist.all_reduce(tensor, op, group, async_op)
    _ensure(tensor.device)
    try:
        opn = op_name(op)
    except ValueError:  # PREMUL_SUM, BAND, ...: torch's
        return tdist.all_reduce(tensor, op, group, async_op)
    alg.check_reducible(tensor, opn)
    nbytes = tensor.numel() * tensor.element_size()
    if _st.checks:
        _check("all_reduce", tensor, _st.check_group, extra=REDUCE_OPS.index(opn))
    algorithm, predicted = _decide("all_reduce", nbytes, tensor.dtype, op)
    if algorithm == "off":
        return tdist.all_reduce(tensor, op, group, async_op)
    reason = ""
    if codec not in (None, "none") and _st.groups is not None and _st.topology.num_nodes > 1 and \
            tensor.is_floating_point() and opn in ("SUM", "AVG"):  # compression asked for: inter hop only
        from memrt.comm.compress import choose_codec

        chosen = choose_codec(codec, nbytes, tensor.dtype, _st.topology, algorithm, predicted, _st.config.comm)
        algorithm, predicted, reason = chosen.algorithm, chosen.predicted_seconds, chosen.reason
    if _st.mpi is not None and tensor.device.type == "cpu":
        mpi_algo = "hier" if algorithm.startswith("hier") else "flat"
        return _run("all_reduce", tensor, nbytes, mpi_algo + "@mpi", predicted,
                    lambda: _st.mpi.all_reduce(tensor, opn, algorithm=mpi_algo), async_op, [tensor], opn.lower())
    if algorithm.startswith("hier"):
        plug = _plug_for(algorithm, key, tensor.data_ptr())
        chunk = None
        if plug is not None:
            from memrt.comm.compress import pipeline_chunk_bytes

            chunk = pipeline_chunk_bytes(algorithm.split("+", 1)[1], nbytes)
        return _run("all_reduce", tensor, nbytes, algorithm, predicted,
                    lambda: alg.hierarchical_all_reduce(tensor, opn, _st.topology, inter_all_reduce=plug,
                                                        groups=_st.groups, chunk_bytes=chunk), async_op, [tensor],
                    opn.lower(), reason)
    return _flat_torch("all_reduce", tensor, nbytes,
                       lambda: tdist.all_reduce(tensor, op, group, async_op), async_op, predicted, opn.lower(), reason)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None):
    """torch.distributed.broadcast; across nodes once then inside each node when that pays."""
    if not _mine(group) or group_src is not None or src is None:
        return tdist.broadcast(tensor, src, group, async_op, group_src=group_src)
    _ensure(tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    if _st.checks:
        _check("broadcast", tensor, _st.check_group, extra=src)
    if _st.mpi is not None and tensor.device.type == "cpu":
        return _run("broadcast", tensor, nbytes, "flat@mpi", None, lambda: _st.mpi.broadcast(tensor, src),
                    async_op, [tensor])
    algorithm, predicted = _decide("broadcast", nbytes, tensor.dtype, src=src)
    if algorithm == "off":
        return tdist.broadcast(tensor, src, group, async_op)
    if algorithm == "hier":
        return _run("broadcast", tensor, nbytes, "hier", predicted,
                    lambda: alg.hierarchical_broadcast(tensor, src, _st.topology, groups=_st.groups), async_op, [tensor])
    return _flat_torch("broadcast", tensor, nbytes, lambda: tdist.broadcast(tensor, src, group, async_op), async_op,
                       predicted)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False):
    """torch.distributed.all_gather_into_tensor; inter-node first then intra-node on equal nodes."""
    flat_fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    if not _mine(group):
        return flat_fn(output_tensor, input_tensor, group, async_op)
    _ensure(input_tensor.device)
    nbytes = input_tensor.numel() * input_tensor.element_size()
    if _st.checks:
        _check("all_gather", input_tensor, _st.check_group)
    if _st.mpi is not None and input_tensor.device.type == "cpu":
        return _run("all_gather", input_tensor, nbytes, "flat@mpi", None,
                    lambda: _st.mpi.all_gather_into_tensor(output_tensor, input_tensor), async_op, [output_tensor])
    algorithm, predicted = _decide("all_gather", nbytes, input_tensor.dtype)
    if algorithm == "off":
        return flat_fn(output_tensor, input_tensor, group, async_op)
    if algorithm == "hier" and output_tensor.is_contiguous():
        return _run("all_gather", input_tensor, nbytes, "hier", predicted,
                    lambda: alg.hierarchical_all_gather(output_tensor, input_tensor, _st.topology, groups=_st.groups),
                    async_op, [output_tensor])
    return _flat_torch("all_gather", input_tensor, nbytes,
                       lambda: flat_fn(output_tensor, input_tensor, group, async_op), async_op,
                       predicted if algorithm == "flat" else None)


all_gather_single = all_gather_into_tensor


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """torch.distributed.all_gather; equal-shape lists take the hierarchical path when it pays."""
    if not _mine(group) or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        return tdist.all_gather(tensor_list, tensor, group, async_op)
    _ensure(tensor.device)
    nbytes = tensor.numel() * tensor.element_size()
    algorithm, predicted = _decide("all_gather", nbytes, tensor.dtype)
    if algorithm == "off":
        return tdist.all_gather(tensor_list, tensor, group, async_op)
    if algorithm != "hier" or _st.mpi is not None:
        return _flat_torch("all_gather", tensor, nbytes, lambda: tdist.all_gather(tensor_list, tensor, group, async_op),
                           async_op, predicted if algorithm == "flat" else None)
    if _st.checks:
        _check("all_gather", tensor, _st.check_group)

    def fn() -> None:
        out = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        alg.hierarchical_all_gather(out, tensor, _st.topology, groups=_st.groups)
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * tensor.numel():(i + 1) * tensor.numel()].view(tensor.shape))

    return _run("all_gather", tensor, nbytes, "hier", predicted, fn, async_op, list(tensor_list))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = tdist.ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False):
    """torch.distributed.reduce_scatter_tensor; intra-node then inter-node on equal nodes."""
    flat_fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    if not _mine(group):
        return flat_fn(output, input, op, group, async_op)
    _ensure(input.device)
    opn = op_name(op)
    alg.check_reducible(input, opn)
    nbytes = input.numel() * input.element_size()
    if _st.checks:
        _check("reduce_scatter", input, _st.check_group, extra=REDUCE_OPS.index(opn))
    if _st.mpi is not None and input.device.type == "cpu":
        return _run("reduce_scatter", input, nbytes, "flat@mpi", None,
                    lambda: _st.mpi.reduce_scatter_tensor(output, input, opn), async_op, [output], opn.lower())
    algorithm, predicted = _decide("reduce_scatter", nbytes, input.dtype, op)
    if algorithm == "off":
        return flat_fn(output, input, op, group, async_op)
    if algorithm == "hier" and output.is_contiguous():
        return _run("reduce_scatter", input, nbytes, "hier", predicted,
                    lambda: alg.hierarchical_reduce_scatter(output, input, opn, _st.topology, groups=_st.groups),
                    async_op, [output], opn.lower())
    return _flat_torch("reduce_scatter", input, nbytes, lambda: flat_fn(output, input, op, group, async_op), async_op,
                       predicted if algorithm == "flat" else None, opn.lower())


reduce_scatter_single = reduce_scatter_tensor

fusion.use_all_reduce(_all_reduce)  # fused buffers go through memrt's all-reduce
