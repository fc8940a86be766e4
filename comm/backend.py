"""The ``memrt`` process group: every collective of the job goes through memrt.comm's algorithms.

``torch.distributed.init_process_group(backend="memrt")`` (or, under ``MEMRT=1``, any
``init_process_group(backend="gloo" | "nccl" | None)``, rewritten by the activation) creates a
:class:`MemrtProcessGroup`: a Python ``ProcessGroup`` subclass registered with
``torch.distributed.Backend.register_backend``. Each group owns real backends underneath (gloo for CPU
tensors, NCCL for CUDA tensors when asked for) and forwards every call to them, except the collectives
memrt improves, which on the world group go through :mod:`memrt.comm.api` (algorithm chosen per call:
hierarchical, compressed on the slow tier, a ``CommRecord`` per call).

Why a process group and not FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` or a DDP
comm hook: every caller ends in a method of the group object. Python callers (``dist.all_reduce``,
``dist.all_gather_single`` as FSDP2 and DeviceMesh use them) look the method up on the Python object;
C++ callers (DDP's reducer, ``_c10d_functional`` ops that compiled graphs run) call the virtual method,
which pybind's trampoline sends to the same Python method. One object therefore carries DDP without a
hook, FSDP2 eager and compiled, DeviceMesh groups and plain calls. Methods memrt does not improve are
not even overridden: the real backends are also registered on the group per device, so c10d's own
dispatch reaches them unchanged.

memrt's algorithms run on groups created inside :func:`internal_groups` (plain gloo / NCCL, never a
memrt group), and calls made while memrt is already inside a collective on this thread go straight to
the real backend: nothing recurses.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                        BroadcastOptions, ReduceScatterOptions)

from memrt.comm.routing import busy as _busy, inside_internal_groups, internal_groups, passthrough
from memrt.comm.waits import waiting
from memrt.comm.reduction import REDUCE_OPS
from memrt.launcher import attempt_prefix

if TYPE_CHECKING:
    from memrt.comm.topology import Topology
    from memrt.config import MemrtConfig

__all__ = ["BACKEND_NAME", "MemrtProcessGroup", "register", "internal_groups", "passthrough", "inner_spec",
           "set_inner_spec", "spec_for", "is_memrt_group", "default_is_memrt", "ensure_topology", "activation_kwargs"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "memrt"
"""The name to pass to ``init_process_group(backend=...)``."""

_lock = threading.Lock()
_registered = False
_inner = {"cpu": "gloo"}  # device type -> real backend used underneath new memrt groups


def inner_spec() -> dict[str, str]:
    """Device type -> real backend under memrt groups created from now on (``{"cpu": "gloo"}`` by default)."""
    return dict(_inner)


def set_inner_spec(backend: str | None) -> None:
    """The real backend(s) under memrt groups created from now on (:func:`spec_for`)."""
    _use_spec(spec_for(backend))


def _use_spec(spec: dict[str, str]) -> None:
    _inner.clear()
    _inner.update(spec)


def spec_for(backend: str | None) -> dict[str, str]:
    """The real backend(s) under memrt groups, from what the script asked ``init_process_group`` for.

    ``None`` / ``"gloo"``: gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available with
    NCCL and ``None`` was given (torch's own default); ``"nccl"``: NCCL for CUDA, gloo for CPU;
    ``"cpu:gloo,cuda:nccl"`` as written.
    """
    spec: dict[str, str] = {}
    text = (backend or "").strip().lower()
    cuda_ok = torch.cuda.is_available() and tdist.is_nccl_available()
    if ":" in text:
        for part in text.split(","):
            dev, _, name = part.partition(":")
            spec[dev.strip()] = name.strip()
    elif text in ("", "undefined"):
        spec = {"cpu": "gloo", **({"cuda": "nccl"} if cuda_ok else {})}
    elif text == "gloo":
        spec = {"cpu": "gloo", "cuda": "gloo"} if torch.cuda.is_available() else {"cpu": "gloo"}
    elif text == "nccl":
        spec = {"cpu": "gloo", "cuda": "nccl"}
    else:
        raise ValueError(f"backend={backend!r} cannot run under memrt's process group: expected gloo, nccl, "
                         "None or 'cpu:gloo,cuda:nccl' (set MEMRT_COMM=off to keep torch's own backend)")
    bad = {d: n for d, n in spec.items() if n not in ("gloo", "nccl")}
    if bad:
        raise ValueError(f"backend={backend!r}: {bad} is not supported under memrt (gloo or nccl per device)")
    return spec


def _real_backend(name: str, store: Any, rank: int, size: int, timeout: Any, ranks: list[int], group: str) -> Any:
    if name == "gloo":
        be = tdist.ProcessGroupGloo(store, rank, size, timeout)
        be.options.global_ranks_in_group = ranks
        be.options.group_name = group
        return be
    opts = tdist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.global_ranks_in_group = ranks
    opts.group_name = group
    return tdist.ProcessGroupNCCL(store, rank, size, opts)


def _device_store(store: Any, device: str) -> Any:
    """The store keys of ``device``'s real backend: the ones torch gives that backend in a stock group.

    torch hands a backend's creator its group's store under the prefix of the backend's first device
    (``<group>/cpu/``) and gives every other device's backend ``<group>/<device>/``: the key space is
    rebuilt from the group's store under each device's own prefix. memrt's real backends
    use the same keys, so a memrt rank and a rank running torch's own backend (started without ``MEMRT``)
    still connect in ``init_process_group`` and the start-up agreement can name the odd rank out."""
    prefix = f"{device}/{attempt_prefix()}"  # a torchrun restart: the dead attempt's keys stay in the store
    if not isinstance(store, tdist.PrefixStore):  # a group built by hand on a plain store
        return tdist.PrefixStore(prefix, store)
    return tdist.PrefixStore(prefix, store.underlying_store)


def _create(dist_opts: Any, backend_options: Any) -> Any:
    """``Backend.register_backend`` creator (extended API): a memrt group, or a real one inside memrt."""
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    ranks = list(dist_opts.global_ranks_in_group)
    name = dist_opts.group_id
    if inside_internal_groups():  # memrt's own tier groups: a plain real backend (CPU side)
        return _real_backend(_inner.get("cpu", "gloo"), _device_store(store, "cpu"), rank, size,
                             dist_opts.timeout, ranks, name)
    return MemrtProcessGroup(store, rank, size, dist_opts.timeout, global_ranks=ranks, group_name=name)


def register() -> None:
    """Register the ``memrt`` backend with torch.distributed (idempotent; does not change any default)."""
    global _registered
    with _lock:
        if _registered:
            return
        tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def is_memrt_group(group: Any) -> bool:
    return isinstance(group, MemrtProcessGroup)


def default_is_memrt() -> bool:
    return tdist.is_initialized() and is_memrt_group(tdist.distributed_c10d._get_default_group())


def activation_kwargs(args: tuple, kwargs: dict[str, Any], comm_mode: str,
                      when: str = "on") -> tuple[tuple, dict[str, Any], bool]:
    """``init_process_group``'s arguments with the backend switched to memrt when it can carry the job.

    Not switched: ``MEMRT_COMM=off``, an MPI / UCC / custom backend, or backend-specific ``pg_options``;
    with ``when="auto"`` (MEMRT_PROCESS_GROUP's default) also not a job whose CUDA tensors would run on
    NCCL: memrt's own tier groups under its process group are gloo, and that path has not run on a GPU.
    Returns ``(args, kwargs, switched)``.
    """
    backend = args[0] if args else kwargs.get("backend")
    name = str(backend).lower() if backend is not None else None
    if comm_mode == "off" or kwargs.get("pg_options") is not None or (len(args) > 7 and args[7] is not None):
        return args, kwargs, False
    if name is not None and name not in ("gloo", "nccl", "undefined") and \
            not all(p.split(":")[-1].strip() in ("gloo", "nccl") for p in name.split(",")):
        return args, kwargs, False
    spec = spec_for(name)
    if when == "auto" and spec.get("cuda") == "nccl":
        return args, kwargs, False
    _use_spec(spec)
    register()
    if args:
        args = (BACKEND_NAME,) + tuple(args[1:])
    else:
        kwargs = {**kwargs, "backend": BACKEND_NAME}
    return args, kwargs, True


def ensure_topology(config: MemrtConfig | None = None) -> Topology:
    """memrt.comm's topology and tier groups (collective on first use: every rank of the world calls it);
    ``config``: the settings to set up with (default: the environment's)."""
    from memrt.comm.setup import STATE, setup_topology

    if STATE.topology is None:  # set up once per job
        with internal_groups(), passthrough():
            setup_topology(config=config)
    return STATE.topology


# --------------------------------------------------------------------------------------------- Work
class _Work(tdist.Work):
    """A c10d Work (what DDP and functional collectives wait on) around memrt.comm's async result."""

    def __init__(self, inner: Any, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._inner, self._outputs = inner, outputs
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        if self._inner is not None:
            with waiting():
                self._inner.wait()
        return True

    def is_completed(self) -> bool:
        return self._inner is None or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            inner = self._inner
            if inner is None:
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(self._outputs)
            else:  # MemrtWork (value: the outputs) or work.RecordedWork (records the call on completion)
                fut = inner.get_future()
            self._fut = fut
        return self._fut


class _AllWork(tdist.Work):
    """Several Works as one (coalesced calls)."""

    def __init__(self, works: list[Any], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._outputs = works, outputs

    def wait(self, timeout: Any = None) -> bool:
        with waiting():
            for w in self._works:
                if w is not None:
                    w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w is None or w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


def _red(op: Any) -> Any:
    """The ``ReduceOp.RedOpType`` inside the ``ReduceOp`` that c10d's options carry."""
    return getattr(op, "op", op)


def _op_name(op: Any) -> str | None:
    name = str(getattr(op, "op", op)).split(".")[-1].upper()
    return name if name in REDUCE_OPS else None


# ------------------------------------------------------------------------------------- process group
class MemrtProcessGroup(tdist.ProcessGroup):
    """A process group whose collectives run memrt.comm's algorithms over real backends underneath."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any, *, global_ranks: list[int],
                 group_name: str) -> None:
        super().__init__(rank, size)
        self._gname = group_name
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        # the default group (no ranks given), or a group of every rank in rank order: same members, same
        # order, so memrt's world algorithms (on their own tier groups) compute the same thing
        self._is_world = not global_ranks or list(global_ranks) == list(range(tdist.get_world_size()))
        self._inner: dict[str, Any] = {}
        kinds: dict[str, Any] = {}
        for device, name in _inner.items():
            if name not in kinds:
                kinds[name] = _real_backend(name, _device_store(store, device), rank, size, timeout,
                                            list(global_ranks), group_name)
            self._inner[device] = kinds[name]
        for device, be in self._inner.items():
            btype = tdist.ProcessGroup.BackendType.NCCL if _inner[device] == "nccl" else \
                tdist.ProcessGroup.BackendType.GLOO
            self._register_backend(torch.device(device), btype, be)
        self._set_default_backend(tdist.ProcessGroup.BackendType.GLOO if "cuda" not in self._inner or
                                  _inner["cuda"] == "gloo" else tdist.ProcessGroup.BackendType.NCCL)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._gname = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._gname

    def __repr__(self) -> str:
        return f"MemrtProcessGroup(rank={self.rank()}, size={self.size()}, over={self.inner_backends()})"

    def inner_backends(self) -> dict[str, str]:
        return {d: ("nccl" if "NCCL" in type(b).__name__ else "gloo") for d, b in self._inner.items()}

    def _be(self, t: torch.Tensor) -> Any:
        kind = t.device.type
        if kind not in self._inner:
            raise RuntimeError(f"memrt process group has no backend for {kind} tensors (it runs "
                               f"{self.inner_backends()}): pass backend='cpu:gloo,{kind}:...' to init_process_group")
        return self._inner[kind]

    def _routed(self) -> bool:
        """True when this call should run memrt's algorithms (world group, not already inside memrt)."""
        if _busy():
            return False
        if not self._is_world:
            return False
        ensure_topology()
        return True

    # ------------------------------------------------------------------ the improved collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceOptions()
        if len(tensors) != 1 or _op_name(opts.reduceOp) is None or not self._routed():
            return self._flat("all_reduce", tensors[0], lambda: self._be(tensors[0]).allreduce(tensors, opts),
                              opts.reduceOp)
        from memrt.comm import api

        with passthrough():
            work = api.all_reduce_with(tensors[0], _red(opts.reduceOp), None, True,
                                       flat=lambda: self._be(tensors[0]).allreduce(tensors, opts))
        return _Work(work, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceCoalescedOptions()
        if _op_name(opts.reduceOp) is None or not self._routed():
            return self._be(tensors[0]).allreduce_coalesced(tensors, opts)
        works = [self.allreduce([t], _ar_opts(opts.reduceOp)) for t in tensors]
        return _AllWork(works, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else BroadcastOptions()
        if len(tensors) != 1 or not self._routed():
            return self._flat("broadcast", tensors[0], lambda: self._be(tensors[0]).broadcast(tensors, opts))
        from memrt.comm import api

        with passthrough():
            work = api.broadcast(tensors[0], src=self._global_ranks[opts.rootRank], async_op=True)
        return _Work(work, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        if len(input_tensors) != 1 or not self._routed():
            return self._flat("all_gather", input_tensors[0],
                              lambda: self._be(input_tensors[0]).allgather(output_tensors, input_tensors, opts))
        from memrt.comm import api

        with passthrough():
            work = api.all_gather(output_tensors[0], input_tensors[0], async_op=True)
        return _Work(work, output_tensors[0])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else AllgatherOptions()
        if not self._routed():
            return self._flat("all_gather", input, lambda: self._be(input)._allgather_base(output, input, opts))
        from memrt.comm import api

        with passthrough():
            work = api.all_gather_into_tensor(output, input, async_op=True)
        return _Work(work, [output])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = opts if opts is not None else ReduceScatterOptions()
        if _op_name(opts.reduceOp) is None or not self._routed():
            return self._flat("reduce_scatter", input,
                              lambda: self._be(input)._reduce_scatter_base(output, input, opts), opts.reduceOp)
        from memrt.comm import api

        with passthrough():
            work = api.reduce_scatter_tensor(output, input, _red(opts.reduceOp), async_op=True)
        return _Work(work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllWork(works, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _AllWork(works, outputs)

    def barrier(self, opts: Any = None) -> Any:
        """The real backend's barrier (on the device c10d chose for it, else the first backend's)."""
        from torch._C._distributed_c10d import BarrierOptions

        opts = opts if opts is not None else BarrierOptions()
        device = getattr(opts, "device", None)
        kind = device.type if device is not None and device.type in self._inner else next(iter(self._inner))
        return _RecordingWork(self._inner[kind].barrier(opts), lambda: None)

    # ------------------------------------------------------------------ sub-groups and pass-through
    def _flat(self, op: str, t: torch.Tensor, call: Any, reduce_op: Any = None) -> Any:
        """The real backend's collective, recorded in the comm log (tiers from the group's ranks)."""
        if _busy():
            return call()
        start = time.perf_counter()
        work = call()
        return _RecordingWork(work, lambda: _record_flat(op, t, self._global_ranks, reduce_op, start))


def _outside_dynamo(cls: type, names: tuple[str, ...]) -> None:
    """Mark the collectives dynamo must not trace. DDP calls the process group from C++ inside a compiled
    region (``torch.compile(DDP(model))``: the reducer's bucket rebuild broadcasts in ``_pre_forward``), and
    dynamo would otherwise trace these Python frames and fail on the group's attributes."""
    for name in names:
        setattr(cls, name, torch.compiler.disable(getattr(cls, name), recursive=True))


_outside_dynamo(MemrtProcessGroup, ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "all_gather_single",
                                    "reduce_scatter_single", "allgather_into_tensor_coalesced",
                                    "reduce_scatter_tensor_coalesced", "barrier"))


class _RecordingWork(tdist.Work):
    """A real backend's Work: its ``wait`` counts as the calling thread's wait (:mod:`memrt.comm.waits`), and
    ``finish`` runs once it completed (adding the call's CommRecord)."""

    def __init__(self, work: Any, finish: Any) -> None:
        super().__init__()
        self._work, self._finish, self._done = work, finish, False

    def _once(self) -> None:
        if not self._done:
            self._done = True
            self._finish()

    def wait(self, timeout: Any = None) -> bool:
        with waiting():
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._once()
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> torch.futures.Future:
        def done(f: torch.futures.Future) -> Any:
            value = f.value()
            self._once()
            return value

        return self._work.get_future().then(done)


def _ar_opts(op: Any) -> Any:
    o = AllreduceOptions()
    o.reduceOp = op
    return o


def _record_flat(op: str, t: torch.Tensor, ranks: list[int], reduce_op: Any, start: float) -> None:
    """CommRecord of a collective memrt ran flat on a group (intra / inter by the group's ring neighbour)."""
    from memrt.comm.setup import STATE
    from memrt.profiling.recorder import CommRecord, get_recorder

    topo = STATE.topology
    nbytes = t.numel() * t.element_size()
    w = len(ranks)
    sent = {"all_reduce": 2 * (w - 1) / w * nbytes, "broadcast": nbytes, "all_gather": (w - 1) * nbytes,
            "reduce_scatter": (w - 1) / w * nbytes}.get(op, nbytes) if w > 1 else 0
    tier = "intra"
    if topo is not None and w > 1 and topo.rank in ranks:
        nxt = ranks[(ranks.index(topo.rank) + 1) % w]
        tier = "inter" if topo.node_of(nxt) != topo.node_index else "intra"
    redop = (_op_name(reduce_op) or "").lower() if reduce_op is not None else ""
    get_recorder().record_comm(CommRecord(
        op=op, dtype=str(t.dtype).replace("torch.", ""), nbytes=int(nbytes), group_size=w, algorithm="flat",
        seconds=time.perf_counter() - start, tier_bytes={"intra": 0, "inter": 0, tier: int(sent)}, start=start,
        redop=redop))
