"""Hierarchical collectives: intra-node reduce-scatter -> inter-node all-reduce -> intra-node all-gather.

:func:`hierarchical_all_reduce` cuts the tensor into chunks of ``chunk_bytes`` and runs a three-stage
software pipeline: while the intra-node reduce-scatter of chunk k+1 runs (one process group, or the
shared-memory tier for CPU tensors on one host), the inter-node all-reduces of chunks k, k-1, ...
(up to :data:`INTER_DEPTH`, per-segment groups) and the intra-node all-gather of older chunks (a
second intra-node group) are in flight too; the slow link always has queued work.

Reduction order (what makes float results reproducible; the tests check it bitwise):
``result = node_0 (op) node_1 (op) ...`` where ``node_i = r_0 (op) r_1 (op) ... (op) r_{k-1}`` over the
node's ranks in local order, left to right. The intra-node reduce-scatter is an all-to-all followed by
this ordered local reduction; the inter-node step is torch's all-reduce of the segment group (with two
nodes ``a (op) b`` is order-free). AVG is a SUM divided once by the world size at the end
(integer AVG is rejected like torch's gloo does).

Integration seam: ``inter_all_reduce(shard, group)`` replaces the inter-node hop; ``group``
is the tier's handle (a torch ProcessGroup, or an MPI communicator). It may reduce ``shard`` in place
and return None, return the reduced tensor, or return an object with ``wait()`` (a Work) to overlap.
A blocking function is run on one helper thread, in call order, so the pipeline still overlaps.
It is used for SUM/AVG only; MIN/MAX/PRODUCT always use the exact all-reduce.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

from memrt.comm.streams import bound
from memrt.comm.reduction import DONE, combine_, op_name
from memrt.comm.tiers import HierGroups, Tier, torch_groups
from memrt.comm.topology import Topology

__all__ = ["DEFAULT_CHUNK_BYTES", "auto_chunk_bytes", "hierarchical_all_reduce", "hierarchical_broadcast", "hierarchical_all_gather",
           "hierarchical_reduce_scatter", "ordered_reduce_scatter", "check_reducible"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Pipeline chunk: 4 MiB keeps fill/drain under ~10% of a 64 MiB call at 1 Gbit/s (16 chunks)."""

MIN_AUTO_CHUNK_BYTES = 1024 * 1024
"""Smallest chunk the automatic choice uses (per-operation latency dominates below)."""

INTER_DEPTH = 3
"""Inter-node all-reduces kept in flight by the pipeline."""

InterAllReduce = Callable[[torch.Tensor, Any], Any]
InterReduceScatter = Callable[[Tier, torch.Tensor, torch.Tensor, int], Any]

_plug_lock = threading.Lock()
_plug_pool: cf.ThreadPoolExecutor | None = None


def _plug_executor() -> cf.ThreadPoolExecutor:
    global _plug_pool
    with _plug_lock:
        if _plug_pool is None:
            _plug_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrt-inter")
        return _plug_pool


class _FutureWait:
    def __init__(self, fut: cf.Future, view: torch.Tensor) -> None:
        self.fut, self.view = fut, view

    def wait(self, timeout: Any = None) -> bool:
        _apply_result(self.fut.result(), self.view).wait()
        return True


def _apply_result(res: Any, view: torch.Tensor) -> Any:
    """Normalise what a pluggable inter-node function returned into something with wait()."""
    if res is None:
        return DONE
    if isinstance(res, torch.Tensor):
        if res.data_ptr() != view.data_ptr():
            view.copy_(res.reshape(view.shape))
        return DONE
    if hasattr(res, "wait"):
        return _WaitThenCopy(res, view)
    raise TypeError(f"inter_all_reduce returned {type(res).__name__}: expected None, a tensor or a Work")


class _WaitThenCopy:
    def __init__(self, work: Any, view: torch.Tensor) -> None:
        self.work, self.view = work, view

    def wait(self, timeout: Any = None) -> bool:
        value = self.work.wait()
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            value = value[0]
        if isinstance(value, torch.Tensor) and value.data_ptr() != self.view.data_ptr():
            self.view.copy_(value.reshape(self.view.shape))
        return True


def auto_chunk_bytes(nbytes: int, cap: int = DEFAULT_CHUNK_BYTES) -> int:
    """Pipeline chunk for an ``nbytes`` call: ``nbytes / 8`` clamped to [MIN_AUTO_CHUNK_BYTES, cap]."""
    return min(cap, max(MIN_AUTO_CHUNK_BYTES, nbytes // 8))


def check_reducible(tensor: torch.Tensor, op: str) -> None:
    """Raise for reductions torch.distributed rejects, with torch's error type and words."""
    if tensor.is_complex() and op in ("MIN", "MAX", "PRODUCT"):
        # torch.distributed.all_reduce's own check (distributed_c10d.supports_complex)
        raise ValueError(f"all_reduce does not support {op} on complex tensors")
    if op == "AVG" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"ReduceOp.AVG of a {tensor.dtype} tensor is not defined (torch.distributed's gloo "
                        "raises too): all-reduce with SUM and divide, or use a floating-point tensor")


def _bounds(length: int, parts: int) -> list[int]:
    return [length * j // parts for j in range(parts + 1)]


def _ordered_reduce(pieces: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """out = pieces[0] (op) pieces[1] (op) ... left to right (the documented order)."""
    out.copy_(pieces[0])
    for p in range(1, pieces.shape[0]):
        combine_(out, pieces[p], op)


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.contiguous().view(-1), True


def hierarchical_all_reduce(tensor: torch.Tensor, op: Any, topology: Topology, *,
                            inter_all_reduce: InterAllReduce | None = None,
                            chunk_bytes: int | None = None, groups: HierGroups | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place across every rank of ``topology``; returns ``tensor``.

    Collective: every rank calls it with the same shape, dtype, op and chunk_bytes. ``chunk_bytes=None``
    picks ``nbytes / 8`` clamped to [1 MiB, 4 MiB] (at least ~8 chunks in flight for mid sizes).
    """
    opn = op_name(op)
    check_reducible(tensor, opn)
    if chunk_bytes is None:
        chunk_bytes = auto_chunk_bytes(tensor.numel() * tensor.element_size())
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} is not valid: expected a positive number of bytes")
    g = groups if groups is not None else torch_groups(topology)
    flat, copied = _flat(tensor)
    n = flat.numel()
    if n == 0:
        return tensor
    chunk = max(1, chunk_bytes // flat.element_size())
    starts = list(range(0, n, chunk))
    plug = inter_all_reduce if opn in ("SUM", "AVG") else None
    k, j = g.topology.local_size, g.topology.local_rank
    ni = g.topology.node_index

    shm = g.intra_shm if (g.intra_shm is not None and flat.device.type == "cpu") else None
    rs: dict[int, tuple[Any, torch.Tensor | None]] = {}
    ar: dict[int, list[Any]] = {}
    ag: dict[int, tuple[Any, torch.Tensor]] = {}

    def region(c: int) -> torch.Tensor:
        return flat[starts[c]:min(starts[c] + chunk, n)]

    def start_rs(c: int) -> None:
        x = region(c)
        if g.intra_rs is None:
            rs[c] = (DONE, x)
            return
        b = _bounds(x.numel(), k)
        sizes = [b[i + 1] - b[i] for i in range(k)]
        if shm is not None:  # reduced straight from the peers' slabs into my shard
            rs[c] = (shm.reduce_scatter_into(x[b[j]:b[j + 1]], x, sizes, opn), None)
            return
        recv = torch.empty(k * sizes[j], dtype=x.dtype, device=x.device)
        rs[c] = (g.intra_rs.all_to_all(recv, x, [sizes[j]] * k, sizes), recv)

    def finish_rs_start_ar(c: int) -> None:
        work, recv = rs.pop(c)
        work.wait()
        x = region(c)
        b = _bounds(x.numel(), k)
        mine = x[b[j]:b[j + 1]]
        if g.intra_rs is not None and recv is not None and mine.numel():
            _ordered_reduce(recv.view(k, -1), mine, opn)
        works = []
        for s, tier in g.inter.items():
            lo, hi = g.segments[s].bounds(x.numel())
            if hi <= lo:
                continue
            view = x[lo:hi]
            if plug is None:
                works.append(tier.all_reduce(view, opn))
            else:
                fn = bound(plug, view.device if view.is_cuda else None)  # the plug thread: same device and stream
                works.append(_FutureWait(_plug_executor().submit(fn, view, tier.handle), view))
        ar[c] = works

    def finish_ar_start_ag(c: int) -> None:
        for w in ar.pop(c):
            w.wait()
        x = region(c)
        if g.intra_ag is None:
            ag[c] = (DONE, x)
            return
        b = _bounds(x.numel(), k)
        if shm is not None:
            ag[c] = (shm.all_gather_into_views([x[b[i]:b[i + 1]] for i in range(k)], x[b[j]:b[j + 1]]), None)
            return
        width = b[1] - b[0] if x.numel() % k == 0 else -(-x.numel() // k)
        send = x[b[j]:b[j + 1]]
        if send.numel() != width:
            padded = torch.empty(width, dtype=x.dtype, device=x.device)
            padded[:send.numel()].copy_(send)
            send = padded
        out = torch.empty(k * width, dtype=x.dtype, device=x.device)
        ag[c] = (g.intra_ag.all_gather(out, send), out)

    def finish_ag(c: int) -> None:
        work, out = ag.pop(c)
        work.wait()
        if g.intra_ag is None or out is None:
            return
        x = region(c)
        b = _bounds(x.numel(), k)
        width = out.numel() // k
        for i in range(k):
            if i != j and b[i + 1] > b[i]:
                x[b[i]:b[i + 1]].copy_(out[i * width:i * width + b[i + 1] - b[i]])

    del ni
    # Lookahead keeps up to INTER_DEPTH inter-node all-reduces queued, so the slow link never waits for
    # the intra-node stages; the op order on every group is fixed by the loop, never by timing.
    for c in range(len(starts)):
        start_rs(c)
        if c >= 1:
            finish_rs_start_ar(c - 1)
        while len(ar) > INTER_DEPTH:
            finish_ar_start_ag(min(ar))
        while len(ag) > 1:
            finish_ag(min(ag))
    finish_rs_start_ar(len(starts) - 1)
    while ar:
        finish_ar_start_ag(min(ar))
        while len(ag) > 1:
            finish_ag(min(ag))
    while ag:
        finish_ag(min(ag))
    if opn == "AVG":
        flat.div_(g.topology.world_size)
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def hierarchical_broadcast(tensor: torch.Tensor, src: int, topology: Topology, *,
                           chunk_bytes: int = DEFAULT_CHUNK_BYTES, groups: HierGroups | None = None) -> torch.Tensor:
    """Broadcast from global rank ``src``: across nodes once (one inter group), then inside each node."""
    g = groups if groups is not None else torch_groups(topology)
    topo = g.topology
    flat, copied = _flat(tensor)
    n = flat.numel()
    ns = topo.node_of(src)
    src_local = topo.nodes[ns].index(src)
    seg = next(s for s, sg in enumerate(g.segments) if sg.owners[ns] == src_local)
    relay_local = g.segments[seg].owners[topo.node_index]  # who receives for my node
    inter = g.inter.get(seg)
    intra = g.intra_shm if (g.intra_shm is not None and flat.device.type == "cpu") else g.intra_ag
    chunk = max(1, chunk_bytes // max(flat.element_size(), 1))
    pending: list[Any] = []
    for c0 in range(0, n, chunk):
        x = flat[c0:c0 + chunk]
        if inter is not None and topo.num_nodes > 1:
            inter.broadcast(x, root=ns).wait()  # inter tier members are ordered by node
        if intra is not None:
            pending.append(intra.broadcast(x, root=relay_local))
        if len(pending) > 2:
            pending.pop(0).wait()
    for w in pending:
        w.wait()
    if copied:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def ordered_reduce_scatter(tier: Tier, inp: torch.Tensor, op: str) -> torch.Tensor:
    """``inp`` holds ``tier.size`` equal blocks; returns this member's block reduced in member order."""
    m = inp.numel() // tier.size
    recv = torch.empty(tier.size * m, dtype=inp.dtype, device=inp.device)
    tier.all_to_all(recv, inp.contiguous(), [m] * tier.size, [m] * tier.size).wait()
    out = torch.empty(m, dtype=inp.dtype, device=inp.device)
    if m:
        _ordered_reduce(recv.view(tier.size, m), out, op)
    return out


def _pipeline(started: Iterable[Any], second: Callable[[Any], Any], last: Callable[[Any], None]) -> None:
    """Three stages over chunks, one chunk apart: while ``started`` issues chunk i's first (asynchronous)
    stage, chunk i-1 runs ``second`` (which waits for its first stage and issues the next) and chunk i-2
    ``last``. Every chunk passes every stage in chunk order, on every rank alike."""
    first_q: list[Any] = []
    second_q: list[Any] = []
    for item in started:
        first_q.append(item)
        if len(first_q) > 1:
            second_q.append(second(first_q.pop(0)))
        if len(second_q) > 1:
            last(second_q.pop(0))
    while first_q:
        second_q.append(second(first_q.pop(0)))
    while second_q:
        last(second_q.pop(0))


def _uniform(g: HierGroups) -> bool:
    return g.topology.is_uniform and g.topology.num_nodes > 1 and g.slot_tier is not None


def hierarchical_all_gather(out: torch.Tensor, inp: torch.Tensor, topology: Topology, *,
                            groups: HierGroups | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """``out`` (world * inp.numel(), rank order) gathers every rank's ``inp``: inter-node first, then intra.

    Pipelined over chunks of ``chunk_bytes`` of each rank's block: the inter-node all-gather of chunk
    k+1 runs while chunk k is gathered inside the node and copied into place (temporaries stay chunk
    sized). Equal nodes only (raises ValueError otherwise; the caller falls back to flat).
    """
    g = groups if groups is not None else torch_groups(topology)
    if not _uniform(g):
        raise ValueError("hierarchical all-gather needs equal nodes (the caller should use the flat path)")
    topo = g.topology
    m, k, nn = inp.numel(), topo.local_size, topo.num_nodes
    x = inp.reshape(-1).contiguous()
    o = out.view(-1)
    chunk = max(1, chunk_bytes // max(x.element_size(), 1))

    def start_intra(item: tuple[Any, torch.Tensor, int, int]) -> tuple[Any, torch.Tensor, int, int]:
        work, by_node, c0, c1 = item
        work.wait()
        if g.intra_ag is None:
            return None, by_node, c0, c1
        full = torch.empty(k * nn * (c1 - c0), dtype=x.dtype, device=x.device)
        return g.intra_ag.all_gather(full, by_node), full, c0, c1

    def place(item: tuple[Any, torch.Tensor, int, int]) -> None:
        work, full, c0, c1 = item
        if work is not None:
            work.wait()
        view = full.view(k if g.intra_ag is not None else 1, nn, c1 - c0)
        for i, node in enumerate(topo.nodes):
            for jj, r in enumerate(node):
                o[r * m + c0:r * m + c1].copy_(view[jj if g.intra_ag is not None else 0, i])

    def start_inter() -> Iterator[tuple[Any, torch.Tensor, int, int]]:
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            by_node = torch.empty(nn * (c1 - c0), dtype=x.dtype, device=x.device)
            yield g.slot_tier.all_gather(by_node, x[c0:c1]), by_node, c0, c1

    _pipeline(start_inter(), start_intra, place)
    return out


def hierarchical_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: Any, topology: Topology, *,
                                groups: HierGroups | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                                inter_reduce_scatter: InterReduceScatter | None = None) -> torch.Tensor:
    """``out`` = this rank's block of ``inp`` (world blocks, rank order) reduced: intra-node, then inter-node.

    Order: node_0 (op) node_1 ..., each node's ranks in local order. Equal nodes only. Pipelined over
    chunks of ``chunk_bytes`` of each block: the intra-node exchange of chunk k+1 runs while chunk k is
    reduced and exchanged across nodes (the order of every element's reduction does not change).

    ``inter_reduce_scatter(tier, blocks, out, offset)`` replaces the inter-node exchange (SUM / AVG only):
    ``blocks`` holds the node-reduced values for every node of the slot tier (node order, ``out.numel()``
    each), ``offset`` is the chunk's first element within this rank's block; it returns an object whose
    ``wait()`` leaves in ``out`` the sum over nodes in node order (e.g. :func:`memrt.comm.compress.
    compressed_reduce_scatter`, which compresses what crosses the slow link).
    """
    opn = op_name(op)
    check_reducible(inp, opn)
    g = groups if groups is not None else torch_groups(topology)
    if not _uniform(g):
        raise ValueError("hierarchical reduce-scatter needs equal nodes (the caller should use the flat path)")
    topo = g.topology
    k, nn = topo.local_size, topo.num_nodes
    m = out.numel()
    blocks = inp.reshape(-1).view(topo.world_size, m)
    # slot-major layout: for local slot j, the blocks of ranks nodes[0][j], nodes[1][j], ...
    order = torch.tensor([topo.nodes[i][jj] for jj in range(k) for i in range(nn)], device=blocks.device)
    res = torch.empty(m, dtype=inp.dtype, device=inp.device)
    chunk = max(1, chunk_bytes // max(inp.element_size(), 1))
    plug = inter_reduce_scatter if opn in ("SUM", "AVG") and nn > 1 else None

    def start_inter(item: tuple[Any, torch.Tensor, int, int]) -> tuple[Any, torch.Tensor, int, int]:
        work, got, c0, c1 = item
        w = c1 - c0
        if work is not None:  # this slot's nn * w elements from every local rank: reduce in local order
            work.wait()
            mine = torch.empty(nn * w, dtype=got.dtype, device=got.device)
            _ordered_reduce(got.view(k, nn * w), mine, opn)
        else:
            mine = got
        if plug is not None:
            return plug(g.slot_tier, mine, res[c0:c1], c0), None, c0, c1
        recv = torch.empty(nn * w, dtype=mine.dtype, device=mine.device)
        return g.slot_tier.all_to_all(recv, mine, [w] * nn, [w] * nn), recv, c0, c1

    def finish(item: tuple[Any, torch.Tensor | None, int, int]) -> None:
        work, recv, c0, c1 = item
        work.wait()
        if recv is not None:
            _ordered_reduce(recv.view(nn, c1 - c0), res[c0:c1], opn)  # node order

    def start_intra() -> Iterator[tuple[Any, torch.Tensor, int, int]]:
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            w = c1 - c0
            arranged = blocks[order, c0:c1].reshape(-1)
            if g.intra_rs is None:
                yield None, arranged, c0, c1
                continue
            got = torch.empty(k * nn * w, dtype=inp.dtype, device=inp.device)
            yield g.intra_rs.all_to_all(got, arranged, [nn * w] * k, [nn * w] * k), got, c0, c1

    _pipeline(start_intra(), start_inter, finish)
    if opn == "AVG":
        res.div_(topo.world_size)
    out.view(-1).copy_(res)
    return out

