"""Predicted time of every op: :func:`predict`, and the formulas of all_gather, reduce_scatter and broadcast,
flat (the backend's) and memrt's hierarchical.

All-reduce's formulas live in :mod:`memrt.comm.costmodel`; these use the same building blocks (Hockney's
alpha-beta model; ring and binomial-tree costs after Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 19(1), 2005) and the same calibration (the
probe's per-algorithm call overhead and efficiency, ``costmodel.calibrated``), so one link model
decides every op. Only costmodel's public names are used here.

``p`` ranks on ``m`` nodes of at most ``l`` ranks; sizes are the user's bytes:

- all_gather: ``block`` = one rank's input (the output is ``p * block``);
- reduce_scatter: ``nbytes`` = the whole input (each rank keeps ``nbytes / p``);
- broadcast: ``nbytes`` = the tensor.
"""

from __future__ import annotations

import math

from memrt.comm import costmodel as cm

__all__ = ["predict", "flat_all_gather", "hierarchical_all_gather", "flat_reduce_scatter",
           "hierarchical_reduce_scatter", "flat_broadcast", "hierarchical_broadcast", "PIPELINE_CHUNK_BYTES"]

PIPELINE_CHUNK_BYTES = 4 * 1024 * 1024
"""Chunk of memrt's pipelined hierarchical broadcast, all-gather and reduce-scatter (per rank's block for the
last two; hierarchical.DEFAULT_CHUNK_BYTES)."""

Nodes = tuple[tuple[int, ...], ...]


def _shape(nodes: Nodes) -> tuple[int, int, int]:
    return sum(len(n) for n in nodes), len(nodes), max(len(n) for n in nodes)


def _timed(model: cm.LinkModel, op: str, algorithm: str, cost, nbytes: float) -> float:
    """``cost(x)`` of the full size, split into alpha terms (``cost(0)``) and size terms, calibrated with
    ``op``'s own measured call overhead."""
    lat = cost(0.0)
    return cm.calibrated(model, algorithm, lat, cost(nbytes) - lat, nbytes, op)


def predict(algorithm: str, nbytes: int, nodes: Nodes, model: cm.LinkModel, element_size: int = 4, *,
            codec: str | None = None, op: str = "all_reduce", backend: str = "gloo", src: int = 0) -> float:
    """Predicted seconds of ``op`` under ``algorithm`` (flat | hier; ``codec``: the inter-node hop compressed,
    hier only) for ``nbytes`` (the user's tensor: the input; for all_gather one rank's block)."""
    if algorithm not in ("flat", "hier") or codec is not None and algorithm != "hier":
        raise ValueError(f"algorithm={algorithm!r} (codec={codec!r}) is not valid: expected flat, hier or hier "
                         "with a codec (MEMRT_COMM, MEMRT_COMPRESS)")
    if op == "all_reduce":
        if algorithm == "flat":
            return cm.flat_all_reduce(nodes, nbytes, model)
        return cm.hierarchical_all_reduce(nodes, nbytes, model, codec=codec or "none", element_size=element_size)
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
def flat_all_gather(nodes: Nodes, block: float, model: cm.LinkModel) -> float:
    """The backend's ring over all ranks: T = (p-1) alpha + (p-1) block beta_slowest."""
    p, _, _ = _shape(nodes)
    link = cm.ring_link(nodes, model)
    return _timed(model, "all_gather", "flat", lambda b: cm.ring_all_gather(p, p * b, link), block)


def hierarchical_all_gather(nodes: Nodes, block: float, model: cm.LinkModel) -> float:
    """memrt's pipelined all-gather: per chunk of c bytes of each rank's block, inter-node first (the l
    ranks of a node at once, sharing its link), then intra-node plus the copy into rank order (charged
    like a local reduction); K chunks overlap as a two-stage pipeline:

    T = I(c) + A(c) + (K-1) max(I(c), A(c)),  I(x) = AG_ring(m, m x, inter, shared),
    A(x) = AG_ring(l, l m x, intra) + p x gamma
    """
    p, m, l_ranks = _shape(nodes)
    inter = model.tier("inter")

    def stage_i(x: float) -> float:
        return cm.ring_all_gather(m, m * x, inter, shared=l_ranks > 1)

    def stage_a(x: float) -> float:
        return cm.ring_all_gather(l_ranks, l_ranks * m * x, model.intra) + p * x * model.gamma_s_per_byte

    def cost(b: float) -> float:
        chunks = max(1, math.ceil(b / PIPELINE_CHUNK_BYTES))
        c = b / chunks
        return stage_i(c) + stage_a(c) + (chunks - 1) * max(stage_i(c), stage_a(c))

    return _timed(model, "all_gather", "hier", cost, block)


# ---------------------------------------------------------------- reduce_scatter
def flat_reduce_scatter(nodes: Nodes, nbytes: float, model: cm.LinkModel, *, backend: str = "gloo") -> float:
    """The backend's reduce-scatter of the whole input. gloo runs ``reduce_scatter_tensor`` as an
    all-reduce of the whole input (its profiler event is ``gloo:all_reduce`` with the input's shape,
    torch 2.x): cost = the flat all-reduce. Other backends: ring reduce-scatter,
    T = (p-1) alpha + (p-1)/p n (beta_slowest + gamma)."""
    p, _, _ = _shape(nodes)
    link = cm.ring_link(nodes, model)
    gamma = model.gamma_s_per_byte
    if backend == "gloo":
        return _timed(model, "reduce_scatter", "flat", lambda n: cm.ring_all_reduce(p, n, link, gamma), nbytes)
    return _timed(model, "reduce_scatter", "flat", lambda n: cm.ring_reduce_scatter(p, n, link, gamma), nbytes)


def hierarchical_reduce_scatter(nodes: Nodes, nbytes: float, model: cm.LinkModel, *, codec: str = "none",
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
    ratio = cm.compressed_ratio(codec, element_size) if codec != "none" else 1.0
    codec_s = model.codec_s_per_byte.get(codec, 0.0) if codec != "none" else 0.0

    def stage_a(x: float) -> float:
        return x * gamma + cm.ring_reduce_scatter(l_ranks, x, model.intra, gamma)

    def stage_b(x: float) -> float:
        shard = x / l_ranks
        return (cm.ring_reduce_scatter(m, shard * ratio, inter, 0.0, shared=l_ranks > 1)
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


def _flow_beta(link: cm.TierLink, flows: int, local: int) -> float:
    """Per-flow seconds/byte when ``flows`` flows cross one node's link at once: one flow alone gets
    ``beta``; the probe's ``shared_beta`` is the per-flow figure with ``local`` flows, scaled linearly."""
    if flows <= 1:
        return link.beta(False)
    return max(link.beta(False) * flows, link.beta(True) * flows / max(local, 1))


def flat_broadcast(nodes: Nodes, nbytes: float, model: cm.LinkModel, *, src: int = 0) -> float:
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


def hierarchical_broadcast(nodes: Nodes, nbytes: float, model: cm.LinkModel) -> float:
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
