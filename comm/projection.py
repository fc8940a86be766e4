"""Step time of a data-parallel job on a bigger cluster, per way of syncing it: what ``memrt project`` computes.

Every collective's time comes from :mod:`memrt.comm.costmodel` (Hockney's alpha-beta model; ring, tree and
hierarchical costs after Thakur, Rabenseifner & Gropp 2005 and Patarasuk & Yuan 2009); this module only
decides which collectives a step runs, how much of their time the step waits for, and how compute scales.

Assumptions (docs/sections/projection.md): weak scaling (each rank keeps its batch, so a rank's compute per
step is the measured one, divided by its relative speed); one link per node across nodes, shared by the node's
ranks; no congestion beyond that sharing, no stragglers beyond the speeds given.

Arms (the step = compute + exposed communication + the step's other time):

- ``stock``: torch DDP, a flat ring all-reduce per gradient bucket (``predict("flat", ...)``); every rank does
  the same batch, so the slowest rank's compute sets the step.
- ``memrt``: ``MEMRT=1`` exact: per bucket the cost model's pick of flat and hierarchical (what
  ``memrt.comm.select`` does); with ranks of different speeds the balancer gives each rank a share of the
  global batch proportional to its speed, so compute per step = the measured compute x p / sum(speeds).
- ``bf16``, ``int8``: as ``memrt`` with the inter-node hop compressed (``MEMRT_COMPRESS``).
- ``diloco``: ``MEMRT_SYNC=diloco``: per bucket an all-reduce within the (largest) node, overlapped like DDP's;
  every H steps a blocking all-reduce of the float32 parameters over every rank (memrt's pick), amortised
  over the H steps (``outer_s / H`` per step, exposed).
- ``fsdp2``: FSDP2 under ``MEMRT=1``: per unit an all-gather in forward and again in backward, a
  reduce-scatter of its gradients in backward (memrt's pick per op); the optimizer steps a 1/p shard.

Exposed communication (DDP's overlap: Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020): backward readies the buckets in order, bucket i when the backward has produced
its bytes (gradients assumed produced at an even rate over the backward: ready_i = B x bytes up to i / G);
one stream runs the all-reduces in order, each starting at max(its ready time, the previous one's end).
Exposed = max(0, end of the last - B): the last bucket(s), plus whatever the communication exceeds the
backward by. FSDP2 (prefetching every unit's all-gather): per phase, the first all-gather (forward and
backward) and the last reduce-scatter cannot hide; the rest hides behind the phase's compute up to its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from memrt.comm import costmodel as cm
from memrt.comm.select import tier_bytes

__all__ = ["ARMS", "JobFigures", "Cluster", "ArmProjection", "ddp_buckets", "exposed_after", "backward_compute",
           "project", "uniform_nodes", "link_from_gbit", "target_links"]

ARMS = ("stock", "memrt", "bf16", "int8", "diloco", "fsdp2")
DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""torch DDP's default ``bucket_cap_mb`` (25 MiB)."""
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB)."""


@dataclass(kw_only=True, slots=True)
class JobFigures:
    """One rank's step as measured (or given), at relative speed 1."""

    forward_s: float
    """Forward compute per step, seconds."""
    backward_s: float
    """Backward compute per step without waits for communication, seconds (the window DDP overlaps with)."""
    optimizer_s: float = 0.0
    """Optimizer step per step, seconds."""
    other_s: float = 0.0
    """Everything else per step (data loading, logging, the script's own work), seconds; not scaled."""
    bucket_bytes: tuple[float, ...]
    """Gradient bytes of each all-reduce of a step, in the order backward readies them (DDP's buckets)."""
    param_bytes: float | None = None
    """Parameter bytes (float32) that diloco's outer step and FSDP2's all-gathers move; None = the gradients'."""
    element_size: int = 4
    """Bytes per gradient element (4 = float32): what a codec's wire ratio applies to."""
    samples_per_rank: float | None = None
    """Samples each rank processes per step (its batch), for samples/s; None = unknown."""
    tokens_per_sample: float | None = None
    """Tokens per sample (sequence length), for tokens/s; None = unknown."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "optimizer_s", "other_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"JobFigures.{name}={v!r} is not valid: expected seconds >= 0")
        if not self.bucket_bytes or any(not (b > 0 and math.isfinite(b)) for b in self.bucket_bytes):
            raise ValueError(f"JobFigures.bucket_bytes={self.bucket_bytes!r} is not valid: expected sizes > 0")
        for name in ("param_bytes", "samples_per_rank", "tokens_per_sample"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"JobFigures.{name}={v!r} is not valid: expected a number > 0 or None")

    @property
    def grad_bytes(self) -> float:
        return float(sum(self.bucket_bytes))


@dataclass(kw_only=True, slots=True)
class Cluster:
    """The cluster projected to."""

    nodes: cm.Nodes
    """Global ranks per node (uneven allowed), as ``costmodel``'s formulas take them."""
    links: cm.LinkModel
    """Link figures per tier."""
    speeds: tuple[float, ...] | None = None
    """Per rank, its speed relative to the measured rank (0.5 = takes twice as long); None = all 1."""
    backend: str = "nccl"
    """The backend's reduce-scatter: nccl (ring) or gloo (an all-reduce of the whole input)."""

    def __post_init__(self) -> None:
        p = sum(len(n) for n in self.nodes)
        if not self.nodes or any(len(n) < 1 for n in self.nodes):
            raise ValueError(f"Cluster.nodes={self.nodes!r} is not valid: expected nodes of >= 1 rank")
        if self.speeds is not None and (len(self.speeds) != p or any(not s > 0 for s in self.speeds)):
            raise ValueError(f"Cluster.speeds has {len(self.speeds)} values: expected {p} speeds > 0")

    @property
    def ranks(self) -> int:
        return sum(len(n) for n in self.nodes)


@dataclass(kw_only=True, slots=True)
class ArmProjection:
    """One arm's predicted step on one cluster (seconds per step; bytes per step)."""

    arm: str
    nodes: int
    ranks: int
    step_s: float
    """Predicted seconds per step."""
    compute_s: float
    """Forward + backward + optimizer of the rank that sets the pace, seconds."""
    comm_s: float
    """Communication per step if run alone, seconds (diloco: the outer step's share included)."""
    comm_exposed_s: float
    """Communication the step waits for (not hidden behind compute), seconds."""
    other_s: float
    inter_bytes_per_node: float
    """Bytes one node sends across nodes per step (node 0; diloco: the outer step's share)."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    speedup_vs_stock: float | None = None


def ddp_buckets(grad_bytes: float, cap: float = DDP_BUCKET_BYTES, first: float = DDP_FIRST_BUCKET_BYTES) -> tuple[float, ...]:
    """Gradient buckets as torch DDP forms them by default: a first bucket of 1 MiB, then 25 MiB each."""
    if grad_bytes <= 0:
        raise ValueError(f"grad_bytes={grad_bytes!r} is not valid: expected bytes > 0")
    out, left = [min(first, grad_bytes)], grad_bytes - min(first, grad_bytes)
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
    return tuple(out)


def exposed_after(window_s: float, sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Seconds the step waits after a backward of ``window_s`` for its bucket all-reduces (module docstring:
    bucket i ready at window x bytes up to i / all bytes; one stream, in order)."""
    total, done, end = float(sum(sizes)), 0.0, 0.0
    for size, t in zip(sizes, seconds):
        done += size
        end = max(end, window_s * done / total) + t
    return max(0.0, end - window_s)


def backward_compute(measured_s: float, sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """The backward compute B whose step, with the measured all-reduce ``seconds``, waits ``measured_s`` in all:
    B + exposed_after(B) = measured_s (bisection; B + exposed is non-decreasing in B). On CPU backends the
    measured backward includes the waits for the last buckets (memrt.activation.steptime)."""
    lo, hi = max(0.0, measured_s - float(sum(seconds))), measured_s
    if lo >= hi:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid + exposed_after(mid, sizes, seconds) > measured_s:
            hi = mid
        else:
            lo = mid
    return lo


def uniform_nodes(ranks_per_node: Sequence[int]) -> cm.Nodes:
    """Nodes of consecutive global ranks: ``(4, 4, 2)`` -> ((0..3), (4..7), (8, 9))."""
    out, r = [], 0
    for k in ranks_per_node:
        out.append(tuple(range(r, r + k)))
        r += k
    return tuple(out)


def link_from_gbit(gbit: float, latency_s: float, sharing: int = 1) -> cm.TierLink:
    """A tier of ``gbit`` Gbit/s per node: beta = 8 / (gbit 1e9) s/byte for one flow alone (Hockney's beta);
    ``sharing`` flows at once share it (shared_beta = sharing x beta)."""
    beta = 8.0 / (gbit * 1e9)
    return cm.TierLink(alpha_s=latency_s, beta_s_per_byte=beta,
                       shared_beta_s_per_byte=beta * sharing if sharing > 1 else None)


def target_links(measured: cm.LinkModel | None, *, local_ranks: int, measured_local: int = 1,
                 inter_gbit: float | None = None, intra_gbit: float | None = None,
                 inter_latency_s: float | None = None, intra_latency_s: float | None = None) -> cm.LinkModel:
    """The link model of the projected cluster: the measured tiers, with each figure given replacing the measured
    one. The measured inter tier is one node's link: ``shared_beta`` measured with ``measured_local`` flows at once
    is rescaled to ``local_ranks`` flows (same node capacity); without a shared figure, the flows split ``beta``.
    The measured calibration (per-call overheads, efficiency) describes the measured links' implementation: kept
    only when no figure is given. Reductions and codecs keep their measured rates (0 when none were measured).
    Raises ValueError naming the option a missing tier needs."""
    given = any(v is not None for v in (inter_gbit, intra_gbit, inter_latency_s, intra_latency_s))
    if intra_gbit is not None:
        alpha = intra_latency_s if intra_latency_s is not None else measured.intra.alpha_s if measured else 2e-6
        intra = link_from_gbit(intra_gbit, alpha)
    elif measured is not None:
        intra = cm.TierLink(alpha_s=measured.intra.alpha_s if intra_latency_s is None else intra_latency_s,
                            beta_s_per_byte=measured.intra.beta_s_per_byte)
    else:
        raise ValueError("--intra-gbit: the report holds no measured link figures; give the link inside a node")
    m_inter = measured.inter if measured is not None else None
    if inter_gbit is not None:
        alpha = inter_latency_s if inter_latency_s is not None else m_inter.alpha_s if m_inter else 10e-6
        inter = link_from_gbit(inter_gbit, alpha, sharing=local_ranks)
    elif m_inter is not None:
        shared = m_inter.shared_beta_s_per_byte
        per_flow = (shared / max(measured_local, 1) if shared is not None and measured_local > 1
                    else m_inter.beta_s_per_byte)  # seconds per byte of the node's link, all flows together
        inter = cm.TierLink(alpha_s=m_inter.alpha_s if inter_latency_s is None else inter_latency_s,
                            beta_s_per_byte=m_inter.beta_s_per_byte,
                            shared_beta_s_per_byte=max(per_flow * local_ranks, m_inter.beta_s_per_byte)
                            if local_ranks > 1 else None)
    else:
        inter = None
    base = measured or cm.LinkModel(intra=intra)
    keep = measured is not None and not given
    return cm.LinkModel(intra=intra, inter=inter, gamma_s_per_byte=base.gamma_s_per_byte if measured else 0.0,
                        codec_s_per_byte=dict(base.codec_s_per_byte) if measured else {},
                        call_overhead_s=dict(base.call_overhead_s) if keep else {},
                        mid_overhead_s=dict(base.mid_overhead_s) if keep else {},
                        efficiency=dict(base.efficiency) if keep else {})


def _pick(op: str, nbytes: float, nodes: cm.Nodes, links: cm.LinkModel, esize: int, backend: str) -> float:
    """memrt's exact pick: the cheaper of flat and hierarchical (memrt.comm.select.choose's rule)."""
    return min(cm.predict(a, nbytes, nodes, links, esize, op=op, backend=backend) for a in ("flat", "hier"))


def _inter_bytes(nodes: cm.Nodes, pieces: Sequence[tuple[str, str, float, str | None]], esize: int) -> float:
    """Bytes node 0's ranks send across nodes for ``pieces`` of (op, algorithm, nbytes, codec)."""
    if len(nodes) <= 1:
        return 0.0
    return float(sum(tier_bytes(a, int(n), nodes, r, esize, op=op, codec=c)["inter"]
                     for op, a, n, c in pieces for r in nodes[0]))


def _algorithm(op: str, nbytes: float, nodes: cm.Nodes, links: cm.LinkModel, esize: int, backend: str) -> str:
    t = {a: cm.predict(a, nbytes, nodes, links, esize, op=op, backend=backend) for a in ("flat", "hier")}
    return min(t, key=t.get)


def _arm(arm: str, job: JobFigures, cl: Cluster, sync_every: int) -> ArmProjection:
    nodes, links, es, p = cl.nodes, cl.links, job.element_size, cl.ranks
    speeds = cl.speeds or (1.0,) * p
    balanced = arm in ("memrt", "bf16", "int8", "diloco")
    scale = p / sum(speeds) if balanced else 1.0 / min(speeds)  # balancer: shares by speed; else the slowest
    fwd, bwd, opt = job.forward_s * scale, job.backward_s * scale, job.optimizer_s * scale
    buckets = job.bucket_bytes
    params = job.param_bytes or job.grad_bytes
    multi = len(nodes) > 1
    if arm == "fsdp2":
        opt = opt / p
        ag = [_pick("all_gather", b / p, nodes, links, es, cl.backend) for b in buckets]
        rs = [_pick("reduce_scatter", b, nodes, links, es, cl.backend) for b in buckets]
        fwd_exposed = ag[0] + max(0.0, sum(ag[1:]) - fwd)
        bwd_comm = sum(ag) + sum(rs)
        head_tail = ag[-1] + rs[0]  # backward runs the units in reverse: the last unit's gather first
        exposed = fwd_exposed + head_tail + max(0.0, bwd_comm - head_tail - bwd)
        comm = sum(ag) * 2 + sum(rs)
        pieces = [("all_gather", _algorithm("all_gather", b / p, nodes, links, es, cl.backend), b / p, None)
                  for b in buckets] * 2
        pieces += [("reduce_scatter", _algorithm("reduce_scatter", b, nodes, links, es, cl.backend), b, None)
                   for b in buckets]
    else:
        if arm == "stock":
            pieces = [("all_reduce", "flat", b, None) for b in buckets]
            seconds = [cm.predict("flat", b, nodes, links, es) for b in buckets]
        elif arm in ("bf16", "int8") and multi:
            pieces = [("all_reduce", "hier", b, arm) for b in buckets]
            seconds = [cm.predict("hier", b, nodes, links, es, codec=arm) for b in buckets]
        elif arm == "diloco" and multi:
            local = (tuple(range(max(len(n) for n in nodes))),)
            seconds = [_pick("all_reduce", b, local, links, es, cl.backend) for b in buckets]
            pieces = []
        elif arm in ("memrt", "bf16", "int8", "diloco"):
            pieces = [("all_reduce", _algorithm("all_reduce", b, nodes, links, es, cl.backend), b, None)
                      for b in buckets]
            seconds = [_pick("all_reduce", b, nodes, links, es, cl.backend) for b in buckets]
        else:
            raise ValueError(f"arm={arm!r} is not valid: expected one of {', '.join(ARMS)}")
        exposed = exposed_after(bwd, buckets, seconds)
        comm = sum(seconds)
        if arm == "diloco" and multi:
            outer = _pick("all_reduce", params, nodes, links, 4, cl.backend) + _pick("all_reduce", 8, nodes, links, 8,
                                                                                    cl.backend)
            exposed += outer / sync_every
            comm += outer / sync_every
            algo = _algorithm("all_reduce", params, nodes, links, 4, cl.backend)
            inter = _inter_bytes(nodes, [("all_reduce", algo, params, None)], 4) / sync_every
    if not (arm == "diloco" and multi):
        inter = _inter_bytes(nodes, pieces, es)
    compute = fwd + bwd + opt
    step = compute + exposed + job.other_s
    samples = job.samples_per_rank * p / step if job.samples_per_rank else None
    return ArmProjection(arm=arm, nodes=len(nodes), ranks=p, step_s=step, compute_s=compute, comm_s=comm,
                         comm_exposed_s=exposed, other_s=job.other_s, inter_bytes_per_node=inter,
                         samples_per_s=samples,
                         tokens_per_s=samples * job.tokens_per_sample if samples and job.tokens_per_sample else None)


def project(job: JobFigures, cluster: Cluster, arms: Sequence[str] = ARMS, *, sync_every: int = 50) -> list[ArmProjection]:
    """Each arm's :class:`ArmProjection` on ``cluster``; ``speedup_vs_stock`` = stock's step / the arm's."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arm={unknown[0]!r} is not valid: expected one of {', '.join(ARMS)}")
    if sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r} is not valid: expected steps >= 1")
    out = [_arm(a, job, cluster, sync_every) for a in arms]
    stock = next((r for r in out if r.arm == "stock"), None) or _arm("stock", job, cluster, sync_every)
    for r in out:
        r.speedup_vs_stock = stock.step_s / r.step_s if r.step_s > 0 else None
    return out
