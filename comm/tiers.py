"""The process groups of the two tiers, behind one small interface the algorithms use.

A :class:`Tier` is one communicator (a torch ProcessGroup, or an MPI communicator in
:mod:`memrt.comm.mpi_backend`) with the four non-blocking operations the hierarchical algorithms
need: uneven all-to-all, equal-size all-gather, all-reduce and broadcast. :class:`HierGroups` holds
this rank's tiers for one topology: two intra-node groups (reduce-scatter and all-gather run on
separate groups so their chunks overlap) and one inter-node group per segment this rank owns
(:func:`memrt.comm.topology.inter_segments`). Groups are created once per topology and cached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from memrt.comm.topology import Segment, Topology

__all__ = ["Tier", "TorchTier", "HierGroups", "torch_groups", "build_groups", "clear_group_cache"]

logger = logging.getLogger(__name__)

class Tier(Protocol):
    """One communicator; every method starts a non-blocking operation and returns an object with ``wait()``."""

    size: int
    rank: int
    handle: Any
    """What pluggable functions receive as ``group`` (torch ProcessGroup or MPI communicator)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int]) -> Any: ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any: ...

    def all_reduce(self, t: torch.Tensor, op: str) -> Any: ...

    def broadcast(self, t: torch.Tensor, root: int) -> Any: ...


def _torch_op(op: str):
    import torch.distributed as dist

    return {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN,
            "MAX": dist.ReduceOp.MAX, "PRODUCT": dist.ReduceOp.PRODUCT}[op]


class TorchTier:
    """A torch.distributed process group over ``ranks`` (global ranks, member order).

    Members are numbered in the order of ``ranks`` (a node's local order; a slot tier's node order), which
    the algorithms rely on. torch numbers a new group's members by ascending global rank instead; where the
    two differ (nodes given as ``3,2``, or interleaved hosts whose slots are ``(3, 2)``), all-to-all and
    all-gather are re-ordered here, so member i always sends to and receives from ``ranks[i]``."""

    def __init__(self, pg: Any, ranks: Sequence[int], my_rank: int) -> None:
        import torch.distributed as dist

        self.handle = pg
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_rank)
        position = [dist.get_group_rank(pg, r) for r in self.ranks]  # member -> position in torch's group
        self._member_at = None if position == list(range(self.size)) else sorted(range(self.size),
                                                                                 key=position.__getitem__)
        """Group position -> member, where they differ (None: the same order)."""

    def all_to_all(self, out, inp, out_splits, in_splits):
        import torch.distributed as dist

        if self._member_at is None:
            return dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.handle,
                                          async_op=True)
        order = self._member_at
        pieces = _pieces(inp, in_splits)
        send = torch.cat([pieces[m] for m in order])
        recv = torch.empty(sum(out_splits), dtype=out.dtype, device=out.device)
        work = dist.all_to_all_single(recv, send, [out_splits[m] for m in order], [in_splits[m] for m in order],
                                      group=self.handle, async_op=True)
        return _Reordered(work, recv, [out_splits[m] for m in order], order, _pieces(out, out_splits))

    def all_gather(self, out, inp):
        import torch.distributed as dist

        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if self._member_at is None:
            return fn(out, inp, group=self.handle, async_op=True)
        recv = torch.empty_like(out)
        splits = [out.numel() // self.size] * self.size
        work = fn(recv, inp, group=self.handle, async_op=True)
        return _Reordered(work, recv, splits, self._member_at, _pieces(out, splits))

    def all_reduce(self, t, op):
        import torch.distributed as dist

        return dist.all_reduce(t, op=_torch_op(op), group=self.handle, async_op=True)

    def broadcast(self, t, root):
        import torch.distributed as dist

        return dist.broadcast(t, src=self.ranks[root], group=self.handle, async_op=True)


def _pieces(t: torch.Tensor, splits: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of the flat ``t`` of the given lengths."""
    flat, out, at = t.reshape(-1), [], 0
    for n in splits:
        out.append(flat[at:at + n])
        at += n
    return out


class _Reordered:
    """A collective's result in torch's group order, copied into member order once it completes."""

    def __init__(self, work: Any, recv: torch.Tensor, recv_splits: Sequence[int], member_at: Sequence[int],
                 dest: list[torch.Tensor]) -> None:
        self.work, self.recv, self.recv_splits, self.member_at, self.dest = work, recv, recv_splits, member_at, dest

    def wait(self, timeout: Any = None) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            for piece, m in zip(_pieces(self.recv, self.recv_splits), self.member_at):
                self.dest[m].copy_(piece)
        return True


@dataclass(kw_only=True, slots=True)
class HierGroups:
    """This rank's tiers for one topology."""

    topology: Topology
    intra_rs: Tier | None
    """Intra-node group for reduce-scatter (None when this node has one rank)."""
    intra_ag: Tier | None
    """Second intra-node group for all-gather / broadcast (overlaps with intra_rs)."""
    segments: tuple[Segment, ...]
    """Inter-node segments of a chunk (see topology.inter_segments)."""
    inter: dict[int, Tier] = field(default_factory=dict)
    """Segment index -> inter-node tier, for the segments this rank owns (empty with one node)."""
    kind: str = "torch"
    """'torch', 'mpi' or 'mixed'."""
    intra_shm: Any = None
    """Shared-memory intra-node tier for CPU tensors (memrt.comm.shm.ShmTier), when the node is one host."""

    @property
    def slot_tier(self) -> Tier | None:
        """With equal nodes: the inter-node group of this rank's local slot."""
        mine = [t for t in self.inter.values()]
        return mine[0] if len(mine) == 1 else None


_CACHE: dict[tuple, HierGroups] = {}


def clear_group_cache() -> None:
    _CACHE.clear()


def build_groups(topology: Topology, make: Callable[[tuple[int, ...]], Tier | None], kind: str) -> HierGroups:
    """Create every group in the same order on every rank; ``make(ranks)`` is collective over the world."""
    intra_rs = intra_ag = None
    for i, node in enumerate(topology.nodes):
        if len(node) < 2:
            continue
        a, b = make(node), make(node)
        if i == topology.node_index:
            intra_rs, intra_ag = a, b
    segs = topology.segments()
    inter: dict[int, Tier] = {}
    if topology.num_nodes > 1:
        for s, ranks in enumerate(topology.inter_groups()):
            tier = make(ranks)
            if topology.rank in ranks:
                inter[s] = tier
    return HierGroups(topology=topology, intra_rs=intra_rs, intra_ag=intra_ag, segments=segs, inter=inter, kind=kind)


def _shm_eligible(topology: Topology) -> bool:
    """Every node on one host (by discovered host name) and gloo under CPU tensors (the default backend, or the
    real backend under memrt's process group): same on every rank."""
    from memrt.comm.routing import real_backend_name
    from memrt.comm.shm import shm_available

    if not topology.hosts or "gloo" not in real_backend_name("cpu").lower() or not shm_available():
        return False
    return all(len({topology.hosts[r].split("|")[0] for r in node}) == 1 for node in topology.nodes)


def torch_groups(topology: Topology, *, shm: bool | None = None) -> HierGroups:
    """The torch.distributed groups of ``topology`` (collective on first use; cached).

    ``shm`` (default: when eligible) adds the shared-memory intra-node tier for CPU tensors.
    """
    import torch.distributed as dist

    use_shm = _shm_eligible(topology) if shm is None else shm
    key = ("torch", topology.nodes, use_shm, id(dist.distributed_c10d._get_default_group()))
    if key not in _CACHE:
        def make(ranks: tuple[int, ...]) -> Tier | None:
            pg = dist.new_group(list(ranks))
            return TorchTier(pg, ranks, topology.rank) if topology.rank in ranks else None

        groups = build_groups(topology, make, "torch")
        if use_shm:
            from memrt.comm.shm import ShmTier

            for node in topology.nodes:
                if len(node) > 1:
                    pg = dist.new_group(list(node), backend="gloo")
                    if topology.rank in node:
                        groups.intra_shm = ShmTier(pg, node, topology.rank)
        _CACHE[key] = groups
        logger.debug("created hierarchical groups for %s (shared memory: %s)", topology.nodes, use_shm)
    return _CACHE[key]
