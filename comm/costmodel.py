"""The alpha-beta(-gamma) cost model of memrt.comm's collectives.

A message of ``n`` bytes over one link costs ``alpha + n * beta`` (Hockney's model); reducing ``n``
bytes locally costs ``n * gamma``. Collective costs below follow R. Thakur, R. Rabenseifner and
W. Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1), 2005), and
P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations"
(JPDC 69(2), 2009) for the ring. ``p`` is the number of ranks, ``n`` the bytes of the user's tensor.

Per tier we keep two betas: ``beta`` for one flow alone on the link, and ``shared_beta`` for the
per-flow cost when every local rank crosses the tier at once (hierarchical's inter phase: the
local ranks of a node share that node's link). Links are measured by :mod:`memrt.comm.probe`.

The module holds the link model, the building blocks, the calibration every prediction goes through
(:func:`calibrated`), every op's formulas (flat: the backend's; hierarchical: memrt's) and :func:`predict`, the
one entry point that gives any op's time under any algorithm. Sizes are the user's bytes, ``p`` ranks on ``m``
nodes of at most ``l`` ranks:

- all_reduce: ``n`` = the tensor;
- all_gather: ``block`` = one rank's input (the output is ``p * block``);
- reduce_scatter: ``nbytes`` = the whole input (each rank keeps ``nbytes / p``);
- broadcast: ``nbytes`` = the tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PROBED",
    "TierLink",
    "LinkModel",
    "ring_all_reduce",
    "recursive_doubling_all_reduce",
    "rabenseifner_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "flat_all_reduce",
    "hierarchical_all_reduce",
    "compressed_ratio",
    "default_link_model",
    "link_model_of",
    "ring_link",
    "calibrated",
    "call_overhead",
    "overhead_key",
    "MID_CALL_BYTES",
    "predict",
    "flat_all_gather",
    "hierarchical_all_gather",
    "flat_reduce_scatter",
    "hierarchical_reduce_scatter",
    "flat_broadcast",
    "hierarchical_broadcast",
    "PIPELINE_CHUNK_BYTES",
]

# Bytes on the wire per input byte of float32 for each codec (int8 adds one float32 scale per chunk).
_CODEC_BYTES_PER_FP32_BYTE = {"none": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.25}


@dataclass(kw_only=True, slots=True)
class TierLink:
    """Measured figures of one tier (intra-node or inter-node)."""

    alpha_s: float
    """Latency per message, seconds."""
    beta_s_per_byte: float
    """Transfer time per byte for one flow alone on the link, seconds/byte (1 / bandwidth)."""
    shared_beta_s_per_byte: float | None = None
    """Per-flow seconds/byte when all local ranks cross this tier at once; None = same as beta."""

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"TierLink.{name}={v!r} is not valid: expected a finite number >= 0")

    def beta(self, shared: bool) -> float:
        if shared and self.shared_beta_s_per_byte is not None:
            return self.shared_beta_s_per_byte
        return self.beta_s_per_byte


@dataclass(kw_only=True, slots=True)
class LinkModel:
    """Fitted link figures per tier plus local compute rates: what :func:`choose` predicts with."""

    intra: TierLink
    """Links between ranks of one node."""
    inter: TierLink | None = None
    """Links between nodes; None on a single node."""
    gamma_s_per_byte: float = 0.0
    """Local reduction (sum) time per byte, seconds/byte."""
    codec_s_per_byte: dict[str, float] = field(default_factory=dict)
    """Encode + decode time per input byte of each codec (bf16, fp16, int8), seconds/byte."""
    call_overhead_s: dict[str, float] = field(default_factory=dict)
    """Per algorithm (flat, hier) of all-reduce, and per ``"<op>:<algorithm>"`` of all_gather,
    reduce_scatter and broadcast (``overhead_key``): measured time of an 8-byte call minus its modelled
    alpha terms, seconds (threads, staging, Python; negative when the alphas overstate it), so that the
    latency part of a prediction is the measured small-call time."""
    mid_overhead_s: dict[str, float] = field(default_factory=dict)
    """Per algorithm (and op, as ``call_overhead_s``): the same for a 1 MiB call (``MID_CALL_BYTES``),
    after its efficiency-scaled bandwidth terms. A call of ``n`` bytes pays ``call_overhead_s`` plus ``n / 1 MiB``
    of the difference, all of it from 1 MiB up (on crowded cores a ring step that moves data waits for
    its peer to be scheduled, which an 8-byte call does not show). Empty: the 8-byte figure throughout."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Per algorithm (flat, hier): measured / modelled size-dependent time between a 1 MiB and a mid-size
    call (16 MiB), i.e. how much of the links' measured bandwidth the implementation gets (CPU copies,
    contention between concurrent stages); multiplies the beta and gamma terms. 1.0 when not measured."""
    topology_key: str = ""
    """Key of the topology this was measured on (the probe cache's file name)."""
    measured_at: str = ""
    """UTC time of the probe, ISO 8601."""
    probe_seconds: float = 0.0
    """How long the probe took, seconds."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LinkModel":
        d: dict[str, Any] = json.loads(text)
        d["intra"] = TierLink(**d["intra"])
        d["inter"] = TierLink(**d["inter"]) if d.get("inter") else None
        return cls(**d)

    def tier(self, name: str) -> TierLink:
        if name == "inter":
            return self.inter if self.inter is not None else self.intra
        return self.intra


PROBED: dict[str, LinkModel] = {}
"""The link models this process measured or loaded (memrt.comm.probe), by topology key, newest last."""


def default_link_model() -> LinkModel:
    """Conservative figures used before a probe ran: 10 GB/s intra, 1 Gbit/s inter (documented guesses)."""
    return LinkModel(intra=TierLink(alpha_s=30e-6, beta_s_per_byte=1 / 10e9),
                     inter=TierLink(alpha_s=100e-6, beta_s_per_byte=1 / 125e6, shared_beta_s_per_byte=2 / 125e6),
                     gamma_s_per_byte=1 / 4e9,
                     codec_s_per_byte={"bf16": 1 / 2e9, "fp16": 1 / 2e9, "int8": 1 / 1e9})


def link_model_of(topology: Any, model: LinkModel | None = None) -> tuple[LinkModel, bool]:
    """(the link model to predict with, whether it was measured): ``model`` when given, else the topology's
    probed ``links``, else the newest model this process probed (:data:`PROBED`), else
    :func:`default_link_model` (not measured). ``topology`` needs ``links`` only when ``model`` is None."""
    if model is not None:
        return model, True
    links = topology.links
    if isinstance(links, LinkModel):
        return links, True
    if PROBED:
        return next(reversed(PROBED.values())), True
    return default_link_model(), False


# ----------------------------------------------------------------------------------------------
# Building blocks. Each returns seconds.


def ring_reduce_scatter(p: int, n: float, link: TierLink, gamma: float, *, shared: bool = False) -> float:
    """Ring reduce-scatter: (p-1) steps of n/p bytes, each followed by a reduction of n/p bytes.

    T = (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma   (Thakur et al. 2005, sec. 4; Patarasuk & Yuan 2009)
    """
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * n * (link.beta(shared) + gamma)


def ring_all_gather(p: int, n: float, link: TierLink, *, shared: bool = False) -> float:
    """Ring all-gather of n bytes in total: T = (p-1) alpha + (p-1)/p n beta  (Thakur et al. 2005, sec. 4.1)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * n * link.beta(shared)


def ring_all_reduce(p: int, n: float, link: TierLink, gamma: float, *, shared: bool = False) -> float:
    """Ring all-reduce = reduce-scatter + all-gather:

    T = 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (Patarasuk & Yuan 2009, bandwidth optimal)
    """
    return ring_reduce_scatter(p, n, link, gamma, shared=shared) + ring_all_gather(p, n, link, shared=shared)


def recursive_doubling_all_reduce(p: int, n: float, link: TierLink, gamma: float, *, shared: bool = False) -> float:
    """Recursive doubling: log2(p) rounds exchanging the whole vector.

    T = ceil(log2 p) (alpha + n beta + n gamma)   (Thakur et al. 2005, sec. 4.4; latency optimal, for small n)
    """
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * (link.alpha_s + n * (link.beta(shared) + gamma))


def rabenseifner_all_reduce(p: int, n: float, link: TierLink, gamma: float, *, shared: bool = False) -> float:
    """Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling.

    T = 2 log2(p) alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (Rabenseifner 2004; Thakur et al. 2005, sec. 4.4)
    """
    if p <= 1:
        return 0.0
    lg = math.ceil(math.log2(p))
    return 2 * lg * link.alpha_s + (p - 1) / p * n * (2 * link.beta(shared) + gamma)


def compressed_ratio(codec: str, element_size: int = 4) -> float:
    """Wire bytes per input byte of a codec for elements of ``element_size`` bytes."""
    if codec not in _CODEC_BYTES_PER_FP32_BYTE:
        raise ValueError(f"codec={codec!r} is not valid: expected one of {', '.join(_CODEC_BYTES_PER_FP32_BYTE)}")
    if codec == "none":
        return 1.0
    wire_element = {"bf16": 2, "fp16": 2, "int8": 1}[codec]
    return min(1.0, wire_element / element_size)


# ----------------------------------------------------------------------------------------------
# What memrt.comm runs.


MID_CALL_BYTES = 1 << 20
"""Size of the calibration call whose overhead applies from this size up (``LinkModel.mid_overhead_s``)."""


def overhead_key(op: str, algorithm: str) -> str:
    """Key of ``op``'s per-call overhead in ``LinkModel.call_overhead_s`` / ``mid_overhead_s``: the
    algorithm's name for all_reduce, ``"<op>:<algorithm>"`` for the other ops."""
    return algorithm if op == "all_reduce" else f"{op}:{algorithm}"


def call_overhead(model: LinkModel, algorithm: str, nbytes: float, op: str = "all_reduce") -> float:
    """Measured per-call overhead of ``algorithm`` for an ``nbytes`` call of ``op`` (see
    ``LinkModel.mid_overhead_s``). Each op has its own figures, since its formula counts other alpha terms
    than all-reduce's; a model probed without them uses all-reduce's."""
    key = overhead_key(op, algorithm)
    if key not in model.call_overhead_s:
        key = algorithm
    small = model.call_overhead_s.get(key, 0.0)
    if key not in model.mid_overhead_s:
        return small
    return small + (model.mid_overhead_s[key] - small) * min(1.0, nbytes / MID_CALL_BYTES)


def calibrated(model: LinkModel, algorithm: str, latency_s: float, bandwidth_s: float, nbytes: float,
               op: str = "all_reduce") -> float:
    """A formula's time as memrt measures it: alpha terms (``latency_s``) + ``op``'s measured per-call overhead
    (:func:`call_overhead`) + ``algorithm``'s efficiency x (beta and gamma terms, ``bandwidth_s``). Every op's
    prediction goes through this, so one link model decides every op."""
    lat = max(0.0, latency_s + call_overhead(model, algorithm, nbytes, op))
    return lat + model.efficiency.get(algorithm, 1.0) * bandwidth_s


def ring_link(nodes: tuple[tuple[int, ...], ...], model: LinkModel) -> TierLink:
    """The link a ring over all ranks runs at: each step waits for its slowest edge, which crosses nodes when
    there are several (one flow per direction: ``beta`` alone, not ``shared_beta``)."""
    if len(nodes) <= 1 or model.inter is None:
        return model.intra
    a, b = model.intra, model.inter
    return TierLink(alpha_s=max(a.alpha_s, b.alpha_s), beta_s_per_byte=max(a.beta_s_per_byte, b.beta_s_per_byte))


def flat_all_reduce(nodes: tuple[tuple[int, ...], ...], n: float, model: LinkModel) -> float:
    """torch.distributed's (gloo's) ring over all ranks, ordered by rank.

    Each ring step waits for its slowest edge; with ranks grouped by node, the slowest edge crosses
    nodes, one flow per direction (so ``beta`` alone, not ``shared_beta``).
    """
    p = sum(len(n_) for n_ in nodes)
    link = ring_link(nodes, model)
    lat = ring_all_reduce(p, 0, link, model.gamma_s_per_byte)
    return calibrated(model, "flat", lat, ring_all_reduce(p, n, link, model.gamma_s_per_byte) - lat, n)


def hierarchical_all_reduce(nodes: tuple[tuple[int, ...], ...], n: float, model: LinkModel, *,
                            codec: str = "none", element_size: int = 4) -> float:
    """Intra-node reduce-scatter -> inter-node all-reduce of the shard -> intra-node all-gather.

    With l ranks per node and m nodes (the largest node sets the pace):
      T = RS_ring(l, n, intra) + AR_inter(m, n/l) + AG_ring(l, n, intra)
    The l local ranks run their inter all-reduces at once and share the node's link (``shared_beta``).
    With a codec the inter shard travels compressed (``compressed_ratio``) and pays encode/decode:
    for m = 2 an all-gather of the compressed shard (each rank receives (m-1) n/l c bytes), else a
    compressed reduce-scatter + all-gather (2 (m-1)/m n/l c bytes).
    """
    m = len(nodes)
    l_ranks = max(len(x) for x in nodes)
    gamma = model.gamma_s_per_byte

    def stages(nbytes: float) -> float:
        t = ring_reduce_scatter(l_ranks, nbytes, model.intra, gamma) + ring_all_gather(l_ranks, nbytes, model.intra)
        if m <= 1:
            return t
        inter = model.tier("inter")
        shared = l_ranks > 1
        shard = nbytes / l_ranks
        if codec == "none":
            return t + ring_all_reduce(m, shard, inter, gamma, shared=shared)
        wire = shard * compressed_ratio(codec, element_size)
        if m == 2:
            return t + inter.alpha_s + (m - 1) * wire * inter.beta(shared) + (m - 1) * shard * gamma
        return t + 2 * (m - 1) * inter.alpha_s + 2 * (m - 1) / m * wire * inter.beta(shared) + (m - 1) / m * shard * gamma

    lat = stages(0)
    work = 0.0
    if codec != "none" and m > 1:  # local encode/decode, measured directly: not scaled by the efficiency
        work = (1 if m == 2 else 2) * n / l_ranks * model.codec_s_per_byte.get(codec, 0.0)
    return calibrated(model, "hier", lat, stages(n) - lat, n) + work


# --- every op: predict() and the all_gather, reduce_scatter and broadcast formulas -------------------------

PIPELINE_CHUNK_BYTES = 4 * 1024 * 1024
"""Chunk of memrt's pipelined hierarchical broadcast, all-gather and reduce-scatter (per rank's block for the
last two; hierarchical.DEFAULT_CHUNK_BYTES)."""

Nodes = tuple[tuple[int, ...], ...]


def _shape(nodes: Nodes) -> tuple[int, int, int]:
    return sum(len(n) for n in nodes), len(nodes), max(len(n) for n in nodes)


def _timed(model: LinkModel, op: str, algorithm: str, cost, nbytes: float) -> float:
    """``cost(x)`` of the full size, split into alpha terms (``cost(0)``) and size terms, calibrated with
    ``op``'s own measured call overhead."""
    lat = cost(0.0)
    return calibrated(model, algorithm, lat, cost(nbytes) - lat, nbytes, op)


def predict(algorithm: str, nbytes: int, nodes: Nodes, model: LinkModel, element_size: int = 4, *,
            codec: str | None = None, op: str = "all_reduce", backend: str = "gloo", src: int = 0) -> float:
    """Predicted seconds of ``op`` under ``algorithm`` (flat | hier; ``codec``: the inter-node hop compressed,
    hier only) for ``nbytes`` (the user's tensor: the input; for all_gather one rank's block)."""
    if algorithm not in ("flat", "hier") or codec is not None and algorithm != "hier":
        raise ValueError(f"algorithm={algorithm!r} (codec={codec!r}) is not valid: expected flat, hier or hier "
                         "with a codec (MEMRT_COMM, MEMRT_COMPRESS)")
    if op == "all_reduce":
        if algorithm == "flat":
            return flat_all_reduce(nodes, nbytes, model)
        return hierarchical_all_reduce(nodes, nbytes, model, codec=codec or "none", element_size=element_size)
    table = {("all_gather", "flat"): lambda: flat_all_gather(nodes, nbytes, model),
             ("all_gather", "hier"): lambda: hierarchical_all_gather(nodes, nbytes, model),
             ("reduce_scatter", "flat"): lambda: flat_reduce_scatter(nodes, nbytes, model, backend=backend),
             ("reduce_scatter", "hier"): lambda: hierarchical_reduce_scatter(nodes, nbytes, model),
             ("reduce_scatter", "hier+codec"): lambda: hierarchical_reduce_scatter(
                 nodes, nbytes, model, codec=codec, element_size=element_size),
             ("broadcast", "flat"): lambda: flat_broadcast(nodes, nbytes, model, src=src),
             ("broadcast", "hier"): lambda: hierarchical_broadcast(nodes, nbytes, model)}
    entry = (op, "hier+codec" if codec is not None else algorithm)
    if entry not in table:
        raise ValueError(f"op={op!r} with algorithm={algorithm!r} (codec={codec!r}) has no cost model: expected "
                         "all_reduce, all_gather, reduce_scatter or broadcast with flat or hier")
    return table[entry]()


# ---------------------------------------------------------------- all_gather
def flat_all_gather(nodes: Nodes, block: float, model: LinkModel) -> float:
    """The backend's ring over all ranks: T = (p-1) alpha + (p-1) block beta_slowest."""
    p, _, _ = _shape(nodes)
    link = ring_link(nodes, model)
    return _timed(model, "all_gather", "flat", lambda b: ring_all_gather(p, p * b, link), block)


def hierarchical_all_gather(nodes: Nodes, block: float, model: LinkModel) -> float:
    """memrt's pipelined all-gather: per chunk of c bytes of each rank's block, inter-node first (the l
    ranks of a node at once, sharing its link), then intra-node plus the copy into rank order (charged
    like a local reduction); K chunks overlap as a two-stage pipeline:

    T = I(c) + A(c) + (K-1) max(I(c), A(c)),  I(x) = AG_ring(m, m x, inter, shared),
    A(x) = AG_ring(l, l m x, intra) + p x gamma
    """
    p, m, l_ranks = _shape(nodes)
    inter = model.tier("inter")

    def stage_i(x: float) -> float:
        return ring_all_gather(m, m * x, inter, shared=l_ranks > 1)

    def stage_a(x: float) -> float:
        return ring_all_gather(l_ranks, l_ranks * m * x, model.intra) + p * x * model.gamma_s_per_byte

    def cost(b: float) -> float:
        chunks = max(1, math.ceil(b / PIPELINE_CHUNK_BYTES))
        c = b / chunks
        return stage_i(c) + stage_a(c) + (chunks - 1) * max(stage_i(c), stage_a(c))

    return _timed(model, "all_gather", "hier", cost, block)


# ---------------------------------------------------------------- reduce_scatter
def flat_reduce_scatter(nodes: Nodes, nbytes: float, model: LinkModel, *, backend: str = "gloo") -> float:
    """The backend's reduce-scatter of the whole input. gloo runs ``reduce_scatter_tensor`` as an
    all-reduce of the whole input (its profiler event is ``gloo:all_reduce`` with the input's shape,
    torch 2.x): cost = the flat all-reduce. Other backends: ring reduce-scatter,
    T = (p-1) alpha + (p-1)/p n (beta_slowest + gamma)."""
    p, _, _ = _shape(nodes)
    link = ring_link(nodes, model)
    gamma = model.gamma_s_per_byte
    if backend == "gloo":
        return _timed(model, "reduce_scatter", "flat", lambda n: ring_all_reduce(p, n, link, gamma), nbytes)
    return _timed(model, "reduce_scatter", "flat", lambda n: ring_reduce_scatter(p, n, link, gamma), nbytes)


def hierarchical_reduce_scatter(nodes: Nodes, nbytes: float, model: LinkModel, *, codec: str = "none",
                                element_size: int = 4) -> float:
    """memrt's pipelined reduce-scatter: per chunk (x bytes of input: c bytes of each of the p blocks), a
    copy into slot order, the intra-node exchange and reduction, then the inter-node exchange and reduction
    of this rank's 1/l (the l ranks of a node at once, sharing its link); K chunks overlap:

    T = A(x) + B(x) + (K-1) max(A(x), B(x)),  A(x) = x gamma + RS(l, x, intra),  B(x) = RS(m, x/l, inter, shared)

    With a codec the inter-node blocks travel compressed (``compressed_ratio`` of their bytes) and each
    rank encodes its m-1 outgoing blocks and decodes the m-1 it receives (``codec_s_per_byte`` per byte, in B).
    """
    p, m, l_ranks = _shape(nodes)
    gamma = model.gamma_s_per_byte
    inter = model.tier("inter")
    ratio = compressed_ratio(codec, element_size) if codec != "none" else 1.0
    codec_s = model.codec_s_per_byte.get(codec, 0.0) if codec != "none" else 0.0

    def stage_a(x: float) -> float:
        return x * gamma + ring_reduce_scatter(l_ranks, x, model.intra, gamma)

    def stage_b(x: float) -> float:
        shard = x / l_ranks
        return (ring_reduce_scatter(m, shard * ratio, inter, 0.0, shared=l_ranks > 1)
                + (m - 1) / m * shard * (gamma + codec_s))

    def cost(n: float) -> float:
        chunks = max(1, math.ceil(n / p / PIPELINE_CHUNK_BYTES))
        x = n / chunks
        return stage_a(x) + stage_b(x) + (chunks - 1) * max(stage_a(x), stage_b(x))

    return _timed(model, "reduce_scatter", "hier", cost, nbytes)


# ---------------------------------------------------------------- broadcast
def _tree_rounds(nodes: Nodes, src: int) -> list[int]:
    """Per round of a binomial tree over all ranks (root-relative order, as gloo's broadcast): the most
    edges of that round going from one node to one other node (0: the round stays inside nodes)."""
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    order = sorted(node_of)
    p = len(order)
    root = order.index(src) if src in node_of else 0
    rounds, dist = [], 1
    while dist < p:
        flows: dict[tuple[int, int], int] = {}
        for v in range(min(dist, p - dist)):
            a, b = node_of[order[(v + root) % p]], node_of[order[(v + dist + root) % p]]
            if a != b:
                flows[a, b] = flows.get((a, b), 0) + 1
        rounds.append(max(flows.values(), default=0))
        dist <<= 1
    return rounds


def _flow_beta(link: TierLink, flows: int, local: int) -> float:
    """Per-flow seconds/byte when ``flows`` flows cross one node's link at once: one flow alone gets
    ``beta``; the probe's ``shared_beta`` is the per-flow figure with ``local`` flows, scaled linearly."""
    if flows <= 1:
        return link.beta(False)
    return max(link.beta(False) * flows, link.beta(True) * flows / max(local, 1))


def flat_broadcast(nodes: Nodes, nbytes: float, model: LinkModel, *, src: int = 0) -> float:
    """Binomial tree over all ranks from ``src`` (gloo's broadcast): ceil(log2 p) rounds, each
    ``alpha + n beta`` of its slowest edge (Thakur et al. 2005, sec. 4.1); a round whose edges cross
    from one node to another k at a time shares that link between k flows (``2 x`` one flow's time
    with ``0,1;2,3`` and root 0: ranks 0 and 1 both send to the other node in the last round)."""
    inter = model.tier("inter")
    local = max(len(n) for n in nodes)
    rounds = _tree_rounds(nodes, src)

    def cost(n: float) -> float:
        return sum(inter.alpha_s + n * _flow_beta(inter, flows, local) if flows else
                   model.intra.alpha_s + n * model.intra.beta(False) for flows in rounds)

    return _timed(model, "broadcast", "flat", cost, nbytes)


def hierarchical_broadcast(nodes: Nodes, nbytes: float, model: LinkModel) -> float:
    """memrt's pipelined broadcast: each chunk goes across nodes (binomial tree over m nodes, one flow per
    node) then inside each node (tree over l ranks); with K chunks of c bytes the stages overlap:

    T = I(c) + A(c) + (K-1) max(I(c), A(c)),  I(x) = ceil(log2 m)(alpha + x beta)_inter,
    A(x) = ceil(log2 l)(alpha + x beta)_intra
    """
    _, m, l_ranks = _shape(nodes)
    inter = model.tier("inter")
    lg_m = math.ceil(math.log2(m)) if m > 1 else 0
    lg_l = math.ceil(math.log2(l_ranks)) if l_ranks > 1 else 0

    def stage_i(x: float) -> float:
        return lg_m * (inter.alpha_s + x * inter.beta(False))

    def stage_a(x: float) -> float:
        return lg_l * (model.intra.alpha_s + x * model.intra.beta(False))

    def cost(n: float) -> float:
        chunks = max(1, math.ceil(n / PIPELINE_CHUNK_BYTES))
        c = n / chunks
        return stage_i(c) + stage_a(c) + (chunks - 1) * max(stage_i(c), stage_a(c))

    return _timed(model, "broadcast", "hier", cost, nbytes)
