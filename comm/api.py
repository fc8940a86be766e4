"""The drop-in torch.distributed surface: same names and signatures, topology-aware where it helps.

Collectives on the default group go through memrt (choice of algorithm per call, a CommRecord per
call, peer-failure diagnosis); calls on other groups, and every name memrt does not define, go
straight to torch.distributed. memrt's own algorithms run on one worker thread in call order, so
``async_op=True`` returns a real waitable :class:`MemrtWork` and ordering across ranks is kept.

Algorithm choice (the issue-6 seam): ``memrt.comm.select.choose`` when that module is present, else
``MEMRT_COMM`` (auto = hierarchical when there is more than one node, some node has several ranks
and the tensor is at least :data:`AUTO_MIN_BYTES`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as tdist

from memrt.agreement import check_or_exit as check_settings_agree
from memrt.comm import algorithms as alg
from memrt.comm.health import HealthMonitor, check_signatures, debug_mode
from memrt.comm.tiers import HierGroups, clear_group_cache, op_name, torch_groups
from memrt.comm.topology import Topology, discover

__all__ = ["init_process_group", "destroy_process_group", "get_topology", "setup_topology", "all_reduce",
           "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
           "reduce_scatter_single", "MemrtWork", "AUTO_MIN_BYTES", "set_checks"]

logger = logging.getLogger(__name__)

AUTO_MIN_BYTES = 4 * 1024 * 1024
"""Below this size MEMRT_COMM=auto stays flat (latency dominates; two extra hops do not pay)."""


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
    ``intra_backend="mpi"`` uses MPI for the intra-node tier only.
    """
    from memrt.config import environ
    from memrt.launcher import discover_launch, mpi_rendezvous

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
                init_method = _slurm_init_method(env)
            else:
                from memrt.launcher import _free_port

                init_method, world_size, rank = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}", 1, 0
    tdist.init_process_group(backend="gloo" if mpi_job else backend, init_method=init_method, timeout=timeout,
                             world_size=world_size, rank=rank, store=store, group_name=group_name,
                             pg_options=pg_options, device_id=device_id)
    check_settings_agree()  # before the first collective: ranks with different MEMRT_* settings exit 2
    setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health)


def _mpi_matches(world: int) -> bool:
    try:
        from memrt.launcher import import_mpi4py

        return import_mpi4py().COMM_WORLD.Get_size() == world
    except Exception:  # noqa: BLE001 - no usable MPI under this srun
        return False


def _slurm_init_method(env: dict[str, str]) -> str:
    from memrt.errors import ConfigError

    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("MASTER_ADDR", None, "the rendezvous host: srun did not set SLURM_*NODELIST; "
                                               "export MASTER_ADDR and MASTER_PORT")
    host = first_host(nodelist)
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else \
        20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000
    return f"tcp://{host}:{port}"


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[:nodelist.index("]") + 1]
    if "[" not in head:
        return head.strip()
    prefix, rng = head.split("[", 1)
    first = rng.rstrip("]").split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def setup_topology(*, mpi_job: bool = False, intra_backend: str | None = None, health: bool = True) -> Topology:
    """Discover the topology and create the groups (collective; init_process_group calls it)."""
    from memrt.comm.backend import internal_groups

    with internal_groups():  # under the memrt process group, memrt's own tier groups are plain gloo / NCCL
        return _setup_topology(mpi_job=mpi_job, intra_backend=intra_backend, health=health)


def _setup_topology(*, mpi_job: bool, intra_backend: str | None, health: bool) -> Topology:
    from memrt.config import load_config

    _st.config = load_config(warn_unknown=False)
    topo = discover()
    _st.topology = topo
    if topo.hierarchical_useful or _st.config.comm == "hier":
        if intra_backend == "mpi":
            from memrt.comm.mpi_backend import mixed_groups

            _st.groups = mixed_groups(topo)
        else:
            _st.groups = torch_groups(topo)
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
        from memrt.comm.probe import attach_links  # issue 6: measured links (cached per topology)

        topo = _st.topology = attach_links(topo, groups=_st.groups)
    return topo


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank argument check on or off (collective: call on every rank)."""
    if enabled and _st.check_group is None:
        _st.check_group = tdist.new_group(backend="gloo")
    _st.checks = enabled


def destroy_process_group(group: Any = None) -> None:
    if group is None or group is tdist.GroupMember.WORLD:
        if _st.executor is not None:
            _st.executor.shutdown(wait=True)
        if _st.health is not None:
            _st.health.stop()
        if _st.mpi is not None:
            _st.mpi.close()
        clear_group_cache()
        _st.__init__()
    tdist.destroy_process_group(group)


def get_topology() -> Topology:
    """This job's :class:`Topology` (discovered at init; collective the first time if init was torch's own)."""
    _ensure()
    return _st.topology


def _ensure() -> None:
    if _st.topology is None:
        if not tdist.is_initialized():
            raise RuntimeError("memrt.comm: the default process group is not initialized: call "
                               "memrt.comm.init_process_group() first")
        setup_topology()


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
    """A torch Work that records its CommRecord when waited on, and diagnoses peer failures."""

    def __init__(self, work: Any, finish: Callable[[], None], name: str) -> None:
        self._work, self._finish, self._name = work, finish, name

    def wait(self, *args: Any, **kw: Any) -> bool:
        try:
            ok = self._work.wait(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            _raise_diagnosed(self._name, exc)
        self._finish()
        return ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _raise_diagnosed(name: str, exc: BaseException) -> None:
    from memrt.comm.health import CollectiveMismatchError, PeerFailureError

    if _st.health is None or isinstance(exc, (PeerFailureError, CollectiveMismatchError, TypeError, ValueError)):
        raise exc
    raise _st.health.diagnose(name, exc) from exc


# ---------------------------------------------------------------- recording and choice
def _record(op: str, t: torch.Tensor, nbytes: int, algorithm: str, start: float, tier: dict[str, int],
            predicted: float | None) -> None:
    from memrt.profiling.recorder import CommRecord, get_recorder

    get_recorder().record_comm(CommRecord(
        op=op, dtype=str(t.dtype).replace("torch.", ""), nbytes=int(nbytes), group_size=_world(),
        algorithm=algorithm, seconds=time.perf_counter() - start, tier_bytes=tier, predicted_seconds=predicted,
        start=start))


def _world() -> int:
    return _st.topology.world_size if _st.topology is not None else tdist.get_world_size()


def tier_bytes(op: str, algorithm: str, nbytes: int, topo: Topology) -> dict[str, int]:
    """Bytes this rank sends per tier for one call (ring flat algorithms; memrt's hierarchical ones)."""
    w, n, k = topo.world_size, topo.num_nodes, topo.local_size
    if algorithm.startswith("hier"):
        if op == "all_reduce" and "+" in algorithm:  # issue 6: compressed inter hop
            from memrt.comm.select import tier_bytes as compressed_tier_bytes

            return compressed_tier_bytes(algorithm, nbytes, topo.nodes, topo.rank)
        if op == "all_reduce":
            return {"intra": int(2 * (k - 1) / k * nbytes), "inter": int(2 * (n - 1) / n * nbytes / k) if n > 1 else 0}
        if op == "broadcast":
            return {"intra": int(nbytes), "inter": int(nbytes)}
        m = nbytes // w if op == "reduce_scatter" else nbytes  # per-rank block
        return {"intra": int((k - 1) * n * m), "inter": int((n - 1) * m)}
    crossing = topo.node_of((topo.rank + 1) % w) != topo.node_index
    sent = {"all_reduce": 2 * (w - 1) / w * nbytes, "broadcast": nbytes,
            "all_gather": (w - 1) * nbytes, "reduce_scatter": (w - 1) / w * nbytes}.get(op, nbytes)
    return {"intra": 0, "inter": int(sent)} if crossing else {"intra": int(sent), "inter": 0}


def _decide(op: str, nbytes: int, dtype: torch.dtype, reduce_op: Any = None) -> tuple[str, float | None]:
    cfg, topo = _st.config, _st.topology
    if cfg.comm == "off":
        return "off", None
    if not topo.hierarchical_useful or _st.groups is None:
        return "flat", None
    if op == "all_reduce":
        try:
            from memrt.comm.select import choose  # issue 6: per-call choice by the cost model
        except ImportError:
            choose = None
        if choose is not None:
            try:
                d = choose(op, nbytes, dtype, topo, cfg, reduce_op=reduce_op)
            except TypeError:
                d = choose(op, nbytes, dtype, topo, cfg)
            logger.debug("all_reduce %d B: %s (%s)", nbytes, d.algorithm, d.reason)
            return d.algorithm, d.predicted_seconds
    if op in ("all_gather", "reduce_scatter") and not topo.is_uniform:
        return "flat", None
    if cfg.comm == "hier" or (cfg.comm == "auto" and nbytes >= AUTO_MIN_BYTES):
        return "hier", None
    return "flat", None


def _plug_for(algorithm: str, base_key: Any, flat_ptr: int) -> Callable | None:
    if "+" not in algorithm:
        return None
    codec = algorithm.split("+", 1)[1]
    try:
        from memrt.comm.compress import compressed_all_reduce  # issue 6: compressed inter-node hop
    except ImportError:
        if "compress" not in _st.warned:
            _st.warned.add("compress")
            logger.warning("MEMRT_COMPRESS=%s asked for, but memrt.comm.compress is missing: exact all-reduce", codec)
        return None

    def inter(shard: torch.Tensor, group: Any) -> Any:
        key = None if base_key is None else (base_key, shard.data_ptr() - flat_ptr, shard.numel())
        # async: the payload is on the wire when this returns, the pipeline's wait() decodes it, so the
        # helper thread encodes the next chunk while this one crosses the slow link
        return compressed_all_reduce(shard, group, codec, key, async_op=True)

    return inter


def _run(name: str, t: torch.Tensor, nbytes: int, algorithm: str, predicted: float | None, fn: Callable[[], Any],
         async_op: bool, outputs: list[torch.Tensor]) -> MemrtWork | None:
    start = time.perf_counter()
    tier = tier_bytes(name, algorithm, nbytes, _st.topology)

    def job() -> None:
        try:
            if _st.health is not None:
                with _st.health.inside(name):
                    fn()
            else:
                fn()
        except Exception as exc:  # noqa: BLE001
            _raise_diagnosed(name, exc)
        _record(name, t, nbytes, algorithm, start, tier, predicted)

    work = MemrtWork(_st.executor.submit(job), outputs)
    if async_op:
        return work
    work.wait()
    return None


def _flat_torch(name: str, t: torch.Tensor, nbytes: int, call: Callable[[], Any], async_op: bool,
                predicted: float | None = None) -> Any:
    start = time.perf_counter()
    tier = tier_bytes(name, "flat", nbytes, _st.topology)
    finish = lambda: _record(name, t, nbytes, "flat", start, tier, predicted)  # noqa: E731
    from memrt.comm.backend import passthrough

    try:  # passthrough: a memrt process group underneath runs this flat call as it is (no second routing)
        with (_st.health.inside(name) if _st.health is not None else _null()), passthrough():
            work = call()
    except Exception as exc:  # noqa: BLE001
        _raise_diagnosed(name, exc)
    if async_op:
        return _RecordedWork(work, finish, name)
    finish()
    return None


class _null:
    def __enter__(self) -> None: ...

    def __exit__(self, *a: Any) -> None: ...


def _mine(group: Any) -> bool:
    return (group is None or group is tdist.GroupMember.WORLD) and tdist.is_initialized()


# ---------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: Any = tdist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """torch.distributed.all_reduce; hierarchical (pipelined) when the topology and size make it pay."""
    if _mine(group):
        from memrt.comm import fusion  # issue 6: back-to-back small async calls are coalesced

        fused = fusion.intercept(tensor, op, async_op)
        if fused is not None:
            return fused
    return _all_reduce(tensor, op, group, async_op)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool, *, key: Any = None,
                codec: str | None = None):
    if not _mine(group):
        return tdist.all_reduce(tensor, op, group, async_op)
    _ensure()
    try:
        opn = op_name(op)
    except ValueError:  # PREMUL_SUM, BAND, ...: torch's
        return tdist.all_reduce(tensor, op, group, async_op)
    alg.check_reducible(tensor, opn)
    nbytes = tensor.numel() * tensor.element_size()
    if _st.checks:
        check_signatures("all_reduce", tensor, _st.check_group, extra=list(_OPN).index(opn))
    algorithm, predicted = _decide("all_reduce", nbytes, tensor.dtype, op)
    if algorithm == "off":
        return tdist.all_reduce(tensor, op, group, async_op)
    if codec and codec != "none" and algorithm != "off" and _st.groups is not None and \
            tensor.is_floating_point() and opn in ("SUM", "AVG"):  # compress= asked for: inter hop compressed
        algorithm = f"hier+{codec}"
    elif codec == "none" and "+" in algorithm:
        algorithm = "hier"
    if _st.mpi is not None and tensor.device.type == "cpu":
        mpi_algo = "hier" if algorithm.startswith("hier") else "flat"
        return _run("all_reduce", tensor, nbytes, mpi_algo + "@mpi", predicted,
                    lambda: _st.mpi.all_reduce(tensor, opn, algorithm=mpi_algo), async_op, [tensor])
    if algorithm.startswith("hier"):
        plug = _plug_for(algorithm, key if key is not None else ("all_reduce", tuple(tensor.shape), str(tensor.dtype)),
                         tensor.data_ptr())
        chunk = None
        if plug is not None:
            from memrt.comm.compress import pipeline_chunk_bytes

            chunk = pipeline_chunk_bytes(algorithm.split("+", 1)[1], nbytes)
        return _run("all_reduce", tensor, nbytes, algorithm, predicted,
                    lambda: alg.hierarchical_all_reduce(tensor, opn, _st.topology, inter_all_reduce=plug,
                                                        groups=_st.groups, chunk_bytes=chunk), async_op, [tensor])
    return _flat_torch("all_reduce", tensor, nbytes,
                       lambda: tdist.all_reduce(tensor, op, group, async_op), async_op, predicted)


_OPN = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None):
    """torch.distributed.broadcast; across nodes once then inside each node when that pays."""
    if not _mine(group) or group_src is not None or src is None:
        return tdist.broadcast(tensor, src, group, async_op, group_src=group_src)
    _ensure()
    nbytes = tensor.numel() * tensor.element_size()
    if _st.checks:
        check_signatures("broadcast", tensor, _st.check_group, extra=src)
    if _st.mpi is not None and tensor.device.type == "cpu":
        return _run("broadcast", tensor, nbytes, "flat@mpi", None, lambda: _st.mpi.broadcast(tensor, src),
                    async_op, [tensor])
    algorithm, _ = _decide("broadcast", nbytes, tensor.dtype)
    if algorithm == "off":
        return tdist.broadcast(tensor, src, group, async_op)
    if algorithm == "hier":
        return _run("broadcast", tensor, nbytes, "hier", None,
                    lambda: alg.hierarchical_broadcast(tensor, src, _st.topology, groups=_st.groups), async_op, [tensor])
    return _flat_torch("broadcast", tensor, nbytes, lambda: tdist.broadcast(tensor, src, group, async_op), async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False):
    """torch.distributed.all_gather_into_tensor; inter-node first then intra-node on equal nodes."""
    flat_fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    if not _mine(group):
        return flat_fn(output_tensor, input_tensor, group, async_op)
    _ensure()
    nbytes = input_tensor.numel() * input_tensor.element_size()
    if _st.checks:
        check_signatures("all_gather", input_tensor, _st.check_group)
    if _st.mpi is not None and input_tensor.device.type == "cpu":
        return _run("all_gather", input_tensor, nbytes, "flat@mpi", None,
                    lambda: _st.mpi.all_gather_into_tensor(output_tensor, input_tensor), async_op, [output_tensor])
    algorithm, _ = _decide("all_gather", nbytes, input_tensor.dtype)
    if algorithm == "hier" and output_tensor.is_contiguous():
        return _run("all_gather", input_tensor, nbytes, "hier", None,
                    lambda: alg.hierarchical_all_gather(output_tensor, input_tensor, _st.topology, groups=_st.groups),
                    async_op, [output_tensor])
    return _flat_torch("all_gather", input_tensor, nbytes,
                       lambda: flat_fn(output_tensor, input_tensor, group, async_op), async_op)


all_gather_single = all_gather_into_tensor


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """torch.distributed.all_gather; equal-shape lists take the hierarchical path when it pays."""
    if not _mine(group) or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        return tdist.all_gather(tensor_list, tensor, group, async_op)
    _ensure()
    nbytes = tensor.numel() * tensor.element_size()
    algorithm, _ = _decide("all_gather", nbytes, tensor.dtype)
    if algorithm != "hier" or _st.mpi is not None:
        return _flat_torch("all_gather", tensor, nbytes, lambda: tdist.all_gather(tensor_list, tensor, group, async_op),
                           async_op)
    if _st.checks:
        check_signatures("all_gather", tensor, _st.check_group)

    def fn() -> None:
        out = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        alg.hierarchical_all_gather(out, tensor, _st.topology, groups=_st.groups)
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * tensor.numel():(i + 1) * tensor.numel()].view(tensor.shape))

    return _run("all_gather", tensor, nbytes, "hier", None, fn, async_op, list(tensor_list))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = tdist.ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False):
    """torch.distributed.reduce_scatter_tensor; intra-node then inter-node on equal nodes."""
    flat_fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    if not _mine(group):
        return flat_fn(output, input, op, group, async_op)
    _ensure()
    opn = op_name(op)
    alg.check_reducible(input, opn)
    nbytes = input.numel() * input.element_size()
    if _st.checks:
        check_signatures("reduce_scatter", input, _st.check_group, extra=list(_OPN).index(opn))
    if _st.mpi is not None and input.device.type == "cpu":
        return _run("reduce_scatter", input, nbytes, "flat@mpi", None,
                    lambda: _st.mpi.reduce_scatter_tensor(output, input, opn), async_op, [output])
    algorithm, _ = _decide("reduce_scatter", nbytes, input.dtype)
    if algorithm == "hier" and output.is_contiguous():
        return _run("reduce_scatter", input, nbytes, "hier", None,
                    lambda: alg.hierarchical_reduce_scatter(output, input, opn, _st.topology, groups=_st.groups),
                    async_op, [output])
    return _flat_torch("reduce_scatter", input, nbytes, lambda: flat_fn(output, input, op, group, async_op), async_op)


reduce_scatter_single = reduce_scatter_tensor
