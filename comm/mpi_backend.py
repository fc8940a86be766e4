"""MPI backend through mpi4py: memrt's collectives on CPU tensors, zero-copy.

Tensors are handed to MPI as numpy views of their own memory (``tensor.numpy()``); bfloat16 and
float16 travel as 16-bit integers and are reduced by a user-defined MPI operation that views the
buffers back as torch tensors, so no copy and no float conversion of the payload happens.

Two uses:
- the whole job: ``memrt.comm.init_process_group(backend="mpi")`` (when torch itself has no MPI
  build) or :class:`MPIBackend` directly; all-reduce runs memrt's ordered algorithms over MPI
  communicators (flat = ordered reduce-scatter + all-gather over COMM_WORLD; hier = the pipelined
  hierarchical algorithm with MPI tiers), so float results follow the documented reduction order;
- the intra-node tier only: ``init_process_group(intra_backend="mpi")`` (:func:`mixed_groups`): MPI
  shared memory inside a node, torch process groups across nodes.

Needs mpi4py and an MPI library: ``pip install "memrt[mpi]" mpich``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memrt.comm import hierarchical as alg
from memrt.comm.reduction import combine_, op_name
from memrt.comm.tiers import HierGroups, TorchTier, build_groups
from memrt.comm.topology import Topology

__all__ = ["MPIBackend", "MPITier", "mpi_groups", "mixed_groups", "numpy_view"]

logger = logging.getLogger(__name__)


def _mpi():
    from memrt.launcher import import_mpi4py  # ImportError with the install command

    return import_mpi4py()


def numpy_view(t: torch.Tensor):
    """A numpy array sharing ``t``'s memory (16-bit floats viewed as int16)."""
    if t.device.type != "cpu":
        raise ValueError(f"the MPI backend handles CPU tensors; got one on {t.device}: use a gloo/nccl group "
                         "for device tensors, or move it with .cpu()")
    if not t.is_contiguous():
        raise ValueError("the MPI backend needs contiguous tensors (call .contiguous())")
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()


_OPS: dict[tuple[str, torch.dtype], Any] = {}


def _mpi_op(op: str, dtype: torch.dtype):
    MPI = _mpi()
    if dtype not in (torch.bfloat16, torch.float16):
        return {"SUM": MPI.SUM, "AVG": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX, "PRODUCT": MPI.PROD}[op]
    key = (op, dtype)
    if key not in _OPS:
        def reduce16(inbuf, inoutbuf, datatype, _op=op, _dt=dtype):  # inoutbuf = inbuf (op) inoutbuf
            a = torch.frombuffer(inbuf, dtype=torch.int16).view(_dt)
            b = torch.frombuffer(inoutbuf, dtype=torch.int16).view(_dt)
            combine_(b, a, _op)

        _OPS[key] = MPI.Op.Create(reduce16, commute=True)
    return _OPS[key]


class _Req:
    def __init__(self, req: Any, keep: tuple) -> None:
        self.req, self.keep = req, keep  # keep buffers alive until completion

    def wait(self, timeout: Any = None) -> bool:
        self.req.Wait()
        self.keep = ()
        return True


def _displs(counts) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class MPITier:
    """An MPI communicator as a memrt tier (non-blocking MPI-3 collectives)."""

    def __init__(self, comm: Any) -> None:
        self.handle = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    def all_to_all(self, out, inp, out_splits, in_splits):
        a, b = numpy_view(inp), numpy_view(out)
        s, r = list(map(int, in_splits)), list(map(int, out_splits))
        req = self.handle.Ialltoallv([a, (s, _displs(s))], [b, (r, _displs(r))])
        return _Req(req, (a, b, inp, out))

    def all_gather(self, out, inp):
        a, b = numpy_view(inp), numpy_view(out)
        return _Req(self.handle.Iallgather(a, b), (a, b, inp, out))

    def all_reduce(self, t, op):
        MPI = _mpi()
        a = numpy_view(t)
        return _Req(self.handle.Iallreduce(MPI.IN_PLACE, a, _mpi_op(op, t.dtype)), (a, t))

    def broadcast(self, t, root):
        a = numpy_view(t)
        return _Req(self.handle.Ibcast(a, root=root), (a, t))


def mpi_groups(topology: Topology, comm: Any = None) -> HierGroups:
    """Every tier of ``topology`` as MPI communicators split from ``comm`` (default COMM_WORLD)."""
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    _check_ranks(topology, comm)
    world_group = comm.Get_group()

    def make(ranks: tuple[int, ...]):
        if topology.rank not in ranks:
            return None
        sub = comm.Create_group(world_group.Incl(list(ranks)), tag=_tag(ranks))
        return MPITier(sub)

    return build_groups(topology, make, "mpi")


def _tag(ranks: tuple[int, ...]) -> int:
    return (hash(ranks) & 0x7FFF) + 1


def mixed_groups(topology: Topology, comm: Any = None) -> HierGroups:
    """MPI for the intra-node tier, torch process groups for the inter-node tier."""
    import torch.distributed as dist

    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    _check_ranks(topology, comm)
    nodes = set(topology.nodes)
    world_group = comm.Get_group()

    def make(ranks: tuple[int, ...]):
        if ranks in nodes:  # intra-node: MPI among the node's ranks only
            if topology.rank not in ranks:
                return None
            return MPITier(comm.Create_group(world_group.Incl(list(ranks)), tag=_tag(ranks)))
        pg = dist.new_group(list(ranks))
        return TorchTier(pg, ranks, topology.rank) if topology.rank in ranks else None

    return build_groups(topology, make, "mixed")


def _check_ranks(topology: Topology, comm: Any) -> None:
    if comm.Get_size() != topology.world_size or comm.Get_rank() != topology.rank:
        raise RuntimeError(f"MPI rank {comm.Get_rank()}/{comm.Get_size()} differs from the topology's rank "
                           f"{topology.rank}/{topology.world_size}: start the job with mpiexec so both agree")


class MPIBackend:
    """memrt's collectives over MPI for CPU tensors; ``topology`` enables the hierarchical path."""

    def __init__(self, comm: Any = None, *, topology: Topology | None = None) -> None:
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.topology = topology or Topology.from_nodes((tuple(range(self.size)),), self.rank)
        flat_topo = Topology.from_nodes((tuple(range(self.size)),), self.rank)
        self._flat = build_groups(flat_topo, lambda ranks: MPITier(self.comm.Dup()), "mpi")
        self._hier = mpi_groups(self.topology, self.comm) if self.topology.hierarchical_useful else None
        self.world = MPITier(self.comm)

    def close(self) -> None:
        for g in (self._flat, self._hier):
            if g is None:
                continue
            for tier in [g.intra_rs, g.intra_ag, *g.inter.values()]:
                if tier is not None and tier.handle is not None:
                    try:
                        tier.handle.Free()
                    except Exception:  # noqa: BLE001 - already freed / finalized
                        pass

    def all_reduce(self, tensor: torch.Tensor, op: Any = "SUM", *, algorithm: str = "auto",
                   chunk_bytes: int | None = None) -> torch.Tensor:
        """In place; ``algorithm`` flat | hier | auto (hier when the topology has several nodes)."""
        if tensor.device.type != "cpu":
            numpy_view(tensor)  # raises the error that says what to do
        use_hier = algorithm == "hier" or (algorithm == "auto" and self._hier is not None)
        groups = self._hier if use_hier and self._hier is not None else self._flat
        return alg.hierarchical_all_reduce(tensor, op_name(op), groups.topology, groups=groups, chunk_bytes=chunk_bytes)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.world.broadcast(buf, src).wait()
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        self.world.all_gather(out, inp.contiguous()).wait()
        return out

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: Any = "SUM") -> torch.Tensor:
        opn = op_name(op)
        alg.check_reducible(inp, opn)
        res = alg.ordered_reduce_scatter(self.world, inp.reshape(-1), opn)
        if opn == "AVG":
            res.div_(self.size)
        out.view(-1).copy_(res)
        return out

    def barrier(self) -> None:
        self.comm.Barrier()
