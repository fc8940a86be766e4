"""Per-call choice of the collective algorithm by predicted time, with the reason in words.

``choose(op, nbytes, dtype, topology, config)`` returns a :class:`Decision`: ``flat`` (torch's ring
over all ranks), ``hier`` (intra reduce-scatter -> inter all-reduce -> intra all-gather) or
``hier+<codec>`` (the same with the inter hop compressed: whenever ``MEMRT_COMPRESS``/``compress=``
asks for it, for floating-point sums on more than one node; the reason still lists every prediction). ``MEMRT_COMM=flat|hier`` forces the algorithm; ``off`` means
torch.distributed untouched (reported as flat). Predictions come from :mod:`memrt.comm.costmodel`
with the links measured by :mod:`memrt.comm.probe` (or conservative defaults before a probe).
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
    from memrt.comm import probe

    if probe._MEMO:
        return next(reversed(probe._MEMO.values())), True
    return cm.default_link_model(), False


def predict(algorithm: str, nbytes: int, nodes: tuple[tuple[int, ...], ...], model: cm.LinkModel,
            element_size: int = 4) -> float:
    """Predicted seconds of all-reduce ``algorithm`` on ``nbytes`` (see costmodel for the formulas)."""
    if algorithm == "flat":
        return cm.flat_all_reduce(nodes, nbytes, model)
    if algorithm == "hier":
        return cm.hierarchical_all_reduce(nodes, nbytes, model)
    if algorithm.startswith("hier+"):
        return cm.hierarchical_all_reduce(nodes, nbytes, model, codec=algorithm[5:], element_size=element_size)
    raise ValueError(f"algorithm={algorithm!r} is not valid: expected flat, hier or hier+<codec> (MEMRT_COMM)")


def choose(op: str, nbytes: int, dtype: Any, topology: Any, config: Any = None, *,
           model: cm.LinkModel | None = None, reduce_op: Any = None) -> Decision:
    """Pick the algorithm for one collective (see module docstring). ``config`` is a MemrtConfig or None."""
    nodes = tuple(tuple(n) for n in topology.nodes)
    mode = getattr(config, "comm", "auto") if config is not None else "auto"
    compress = getattr(config, "compress", "none") if config is not None else "none"
    links, measured = _model_of(topology, model)
    esize = element_size_of(dtype)
    multi = len(nodes) > 1
    size = f"{nbytes} B {_dtype_name(dtype)}, {len(nodes)} node(s) x {max(len(n) for n in nodes)}"
    if op != "all_reduce" or not multi:
        why = "single node" if not multi else f"{op} has no hierarchical path"
        t = predict("flat", nbytes, nodes, links, esize) if op == "all_reduce" else 0.0
        return Decision(algorithm="flat", predicted_seconds=t, reason=f"{why}: flat ({size})", candidates={"flat": t})
    sum_like = reduce_op is None or str(reduce_op).split(".")[-1].upper() in ("SUM", "AVG", "REDOPTYPE.SUM")
    codec_ok = compress != "none" and is_floating(dtype) and sum_like
    cands = ["flat", "hier"] + ([f"hier+{compress}"] if codec_ok else [])
    times = {a: predict(a, nbytes, nodes, links, esize) for a in cands}
    src = "" if measured else " (default links: not probed yet)"
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
                    reason=f"auto: {best} predicted {times[best] * 1e3:.3g} ms < {others} ({size}){src}")


def tier_bytes(algorithm: str, nbytes: int, nodes: tuple[tuple[int, ...], ...], rank: int,
               element_size: int = 4) -> dict[str, int]:
    """Bytes this rank sends per tier for one all-reduce of ``nbytes`` under ``algorithm``."""
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    p = sum(len(n) for n in nodes)
    m = len(nodes)
    local = len(nodes[node_of[rank]])
    if algorithm == "flat":
        sent = int(2 * (p - 1) / p * nbytes) if p > 1 else 0
        # ring ordered by rank: the last rank of each node sends across nodes
        crossing = m > 1 and nodes[node_of[rank]][-1] == rank
        return {"inter": sent, "intra": 0} if crossing else {"intra": sent, "inter": 0}
    intra = int(2 * (local - 1) / local * nbytes) if local > 1 else 0
    shard = nbytes / max(local, 1)
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
