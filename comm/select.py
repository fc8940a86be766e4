"""Per-call choice of the collective algorithm by predicted time, with the reason in words.

``choose(op, nbytes, dtype, topology, config)`` returns a :class:`Decision` for all_reduce, all_gather,
reduce_scatter and broadcast alike: ``flat`` (the backend's own algorithm over all ranks), ``hier``
(memrt's hierarchical one: intra-node and inter-node tiers) or, for all-reduce, ``hier+<codec>`` (the
inter hop compressed: whenever ``MEMRT_COMPRESS``/``compress=`` asks for it, for floating-point sums
on more than one node; the reason still lists every prediction). ``MEMRT_COMM=flat|hier`` forces the
algorithm; ``off`` means torch.distributed untouched (reported as flat); ``auto`` takes the smallest
predicted time. Predictions come from :mod:`memrt.comm.costmodel` (all-reduce) and
:mod:`memrt.comm.opcost` (the other ops) with the links measured by :mod:`memrt.comm.probe` (or
conservative defaults before a probe). :func:`tier_bytes` is the one count of bytes sent per tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from memrt.comm import costmodel as cm

__all__ = ["Decision", "choose", "predict", "tier_bytes", "record_call", "element_size_of", "is_floating"]

_ELEMENT_SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_FLOATING = {"float64", "float32", "float16", "bfloat16"}


@dataclass(kw_only=True, slots=True)
class Decision:
    """What to run for one call and why."""

    algorithm: str
    """flat | hier | hier+bf16 | hier+fp16 | hier+int8."""
    predicted_seconds: float
    """Cost-model time of ``algorithm`` for this call, seconds."""
    reason: str
    """One line: forced by which setting, or the predicted times that decided."""
    candidates: dict[str, float] = field(default_factory=dict)
    """Every algorithm considered -> predicted seconds."""

    @property
    def codec(self) -> str | None:
        return self.algorithm.split("+", 1)[1] if "+" in self.algorithm else None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def element_size_of(dtype: Any) -> int:
    return _ELEMENT_SIZE.get(_dtype_name(dtype), 4)


def is_floating(dtype: Any) -> bool:
    return _dtype_name(dtype) in _FLOATING


def _model_of(topology: Any, model: cm.LinkModel | None) -> tuple[cm.LinkModel, bool]:
    if model is not None:
        return model, True
    links = getattr(topology, "links", None)
    if isinstance(links, cm.LinkModel):
        return links, True
    if cm.PROBED:
        return next(reversed(cm.PROBED.values())), True
    return cm.default_link_model(), False


def predict(algorithm: str, nbytes: int, nodes: tuple[tuple[int, ...], ...], model: cm.LinkModel,
            element_size: int = 4, *, op: str = "all_reduce", backend: str = "gloo", src: int = 0) -> float:
    """Predicted seconds of ``op`` under ``algorithm`` for ``nbytes`` (the user's tensor: the input; for
    all_gather one rank's block). Formulas: all_reduce in costmodel, the other ops in opcost."""
    from memrt.comm import opcost

    if op != "all_reduce":
        table = {("all_gather", "flat"): lambda: opcost.flat_all_gather(nodes, nbytes, model),
                 ("all_gather", "hier"): lambda: opcost.hierarchical_all_gather(nodes, nbytes, model),
                 ("reduce_scatter", "flat"): lambda: opcost.flat_reduce_scatter(nodes, nbytes, model, backend=backend),
                 ("reduce_scatter", "hier"): lambda: opcost.hierarchical_reduce_scatter(nodes, nbytes, model),
                 ("reduce_scatter", "hier+codec"): lambda: opcost.hierarchical_reduce_scatter(
                     nodes, nbytes, model, codec=algorithm[5:], element_size=element_size),
                 ("broadcast", "flat"): lambda: opcost.flat_broadcast(nodes, nbytes, model, src=src),
                 ("broadcast", "hier"): lambda: opcost.hierarchical_broadcast(nodes, nbytes, model)}
        entry = (op, "hier+codec" if algorithm.startswith("hier+") else algorithm)
        if entry not in table:
            raise ValueError(f"op={op!r} with algorithm={algorithm!r} has no cost model: expected all_reduce, "
                             "all_gather, reduce_scatter or broadcast with flat or hier")
        return table[entry]()
    if algorithm == "flat":
        return cm.flat_all_reduce(nodes, nbytes, model)
    if algorithm == "hier":
        return cm.hierarchical_all_reduce(nodes, nbytes, model)
    if algorithm.startswith("hier+"):
        return cm.hierarchical_all_reduce(nodes, nbytes, model, codec=algorithm[5:], element_size=element_size)
    raise ValueError(f"algorithm={algorithm!r} is not valid: expected flat, hier or hier+<codec> (MEMRT_COMM)")


_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def choose(op: str, nbytes: int, dtype: Any, topology: Any, config: Any = None, *,
           model: cm.LinkModel | None = None, reduce_op: Any = None, backend: str = "gloo", src: int = 0) -> Decision:
    """Pick the algorithm for one collective (see module docstring). ``config`` is a MemrtConfig or None.

    Every op is chosen the same way: candidates flat and hier (hier+<codec> for compressed all-reduce;
    all_gather / reduce_scatter have a hierarchical path on equal nodes only), MEMRT_COMM forces one,
    ``auto`` takes the smallest predicted time. The choice depends only on arguments that are equal on
    every rank (sizes, topology, the probe's max-reduced link model), so every rank picks the same."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not valid: expected one of {', '.join(_OPS)}")
    nodes = tuple(tuple(n) for n in topology.nodes)
    mode = getattr(config, "comm", "auto") if config is not None else "auto"
    compress = getattr(config, "compress", "none") if config is not None else "none"
    links, measured = _model_of(topology, model)
    esize = element_size_of(dtype)
    multi = len(nodes) > 1
    size = f"{nbytes} B {_dtype_name(dtype)}, {len(nodes)} node(s) x {max(len(n) for n in nodes)}"

    def times_of(cands: list[str]) -> dict[str, float]:
        return {a: predict(a, nbytes, nodes, links, esize, op=op, backend=backend, src=src) for a in cands}

    uniform = len({len(n) for n in nodes}) == 1
    if not multi or (op in ("all_gather", "reduce_scatter") and not uniform):
        why = "single node" if not multi else f"{op} has a hierarchical path on equal nodes only"
        t = times_of(["flat"])
        return Decision(algorithm="flat", predicted_seconds=t["flat"], reason=f"{why}: flat ({size})", candidates=t)
    sum_like = reduce_op is None or str(reduce_op).split(".")[-1].upper() in ("SUM", "AVG", "REDOPTYPE.SUM")
    # "auto" is resolved per call by memrt.comm.compress.choose_codec (the caller passes compress="auto")
    codec_ok = op == "all_reduce" and compress not in ("none", "auto") and is_floating(dtype) and sum_like
    cands = ["flat", "hier"] + ([f"hier+{compress}"] if codec_ok else [])
    times = times_of(cands)
    src_note = "" if measured else " (default links: not probed yet)"
    if mode == "off":
        return Decision(algorithm="flat", predicted_seconds=times["flat"], reason="MEMRT_COMM=off: torch.distributed",
                        candidates=times)
    if mode == "flat":
        return Decision(algorithm="flat", predicted_seconds=times["flat"], reason="forced by MEMRT_COMM=flat",
                        candidates=times)
    if mode == "hier":
        algo = f"hier+{compress}" if codec_ok else "hier"
        return Decision(algorithm=algo, predicted_seconds=times[algo], reason="forced by MEMRT_COMM=hier"
                        + (f" with MEMRT_COMPRESS={compress}" if codec_ok else ""), candidates=times)
    if codec_ok:  # compression was asked for (MEMRT_COMPRESS / compress=): the user's choice, not the model's
        algo = f"hier+{compress}"
        others = ", ".join(f"{a} {times[a] * 1e3:.3g} ms" for a in cands if a != algo)
        return Decision(algorithm=algo, predicted_seconds=times[algo], candidates=times,
                        reason=f"MEMRT_COMPRESS={compress}: {algo} predicted {times[algo] * 1e3:.3g} ms ({others}; {size})")
    best = min(times, key=times.get)
    others = ", ".join(f"{a} {times[a] * 1e3:.3g} ms" for a in cands if a != best)
    return Decision(algorithm=best, predicted_seconds=times[best], candidates=times,
                    reason=f"auto: {op} {best} predicted {times[best] * 1e3:.3g} ms <= {others} ({size}){src_note}")


def tier_bytes(algorithm: str, nbytes: int, nodes: tuple[tuple[int, ...], ...], rank: int,
               element_size: int = 4, *, op: str = "all_reduce") -> dict[str, int]:
    """Bytes ``rank`` sends per tier for one ``op`` call of ``nbytes`` under ``algorithm``, for any
    rank-to-node layout (nodes of any size, ranks of a node need not be contiguous).

    ``nbytes`` is the user's tensor: the input for all_gather (one rank's block) and the full input for
    reduce_scatter. Flat = torch's ring in rank order: rank r sends to r+1 (mod p), so its bytes are
    inter-node exactly when r+1 is on another node; per-rank ring volumes (Thakur et al. 2005):
    all_reduce 2(p-1)/p n, all_gather (p-1) n, reduce_scatter (p-1)/p n, broadcast n (forwarded once).
    Hierarchical (k = ranks of this rank's node, m = nodes): all_reduce intra 2(k-1)/k n (reduce-scatter
    + all-gather), inter 2(m-1)/m n/k (this rank's 1/k of the node's share crosses in a ring over the
    nodes; compressed: the codec's wire ratio, one all-gather of the shard when m = 2); all_gather
    inter (m-1) n then intra (k-1) m n; reduce_scatter intra (k-1) m n/p then inter (m-1) n/p (compressed:
    times the codec's wire ratio);
    broadcast n on each tier. ``...@mpi`` algorithms count as their plain name.
    """
    algorithm = algorithm.split("@", 1)[0]
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    if rank not in node_of:
        raise ValueError(f"rank={rank} is not in the topology's nodes {nodes}")
    p = sum(len(n) for n in nodes)
    m = len(nodes)
    k = len(nodes[node_of[rank]])
    if p <= 1:
        return {"intra": 0, "inter": 0}
    if algorithm in ("flat", "off"):
        sent = {"all_reduce": 2 * (p - 1) / p * nbytes, "broadcast": nbytes, "all_gather": (p - 1) * nbytes,
                "reduce_scatter": (p - 1) / p * nbytes}.get(op, nbytes)
        crossing = node_of[(rank + 1) % p] != node_of[rank]
        return {"intra": 0, "inter": int(sent)} if crossing else {"intra": int(sent), "inter": 0}
    if op == "broadcast":
        return {"intra": int(nbytes) if k > 1 else 0, "inter": int(nbytes) if m > 1 else 0}
    if op in ("all_gather", "reduce_scatter"):
        block = nbytes / p if op == "reduce_scatter" else nbytes  # one rank's block
        wire = cm.compressed_ratio(algorithm.split("+", 1)[1], element_size) if "+" in algorithm else 1.0
        return {"intra": int((k - 1) * m * block), "inter": int((m - 1) * block * wire)}
    intra = int(2 * (k - 1) / k * nbytes) if k > 1 else 0
    shard = nbytes / k
    if algorithm == "hier":
        inter = int(2 * (m - 1) / m * shard) if m > 1 else 0
    else:
        ratio = cm.compressed_ratio(algorithm.split("+", 1)[1], element_size)
        inter = int(shard * ratio * (1 if m == 2 else 2 * (m - 1) / m)) if m > 1 else 0
    return {"intra": intra, "inter": inter}


def record_call(decision: Decision, *, op: str, nbytes: int, dtype: Any, nodes: tuple[tuple[int, ...], ...],
                rank: int, seconds: float, start: float | None = None) -> None:
    """Append this call's predicted vs measured time to the process recorder (a ``CommRecord``)."""
    from memrt.profiling.recorder import CommRecord, get_recorder

    get_recorder().record_comm(CommRecord(
        op=op, dtype=_dtype_name(dtype), nbytes=int(nbytes), group_size=sum(len(n) for n in nodes),
        algorithm=decision.algorithm, seconds=float(seconds),
        tier_bytes=tier_bytes(decision.algorithm, nbytes, nodes, rank, element_size_of(dtype)),
        predicted_seconds=decision.predicted_seconds, start=time.perf_counter() - seconds if start is None else start))
