"""How one collective call runs: the one place that decides, with the reason in words.

A call's :class:`Decision` names the algorithm (``flat``: the backend's own over all ranks; ``hier``:
memrt's hierarchical one, intra-node and inter-node tiers; ``off``: torch.distributed untouched) and,
apart from it, the codec of the inter-node hop (None: exact), with the predicted seconds and the reason.
The comm log prints the two together as :attr:`Decision.label` (``hier+int8``).

- :func:`choose` is the cost model's pick for all_reduce, all_gather, reduce_scatter and broadcast alike,
  from values equal on every rank (sizes, topology, the probe's max-reduced links), so every rank picks
  the same. ``MEMRT_COMM=flat|hier`` forces the algorithm; ``auto`` takes the smallest predicted time.
  ``compress=`` (a codec name or ``auto``) asks to compress the inter-node hop of a floating-point sum on
  more than one node (all_reduce; reduce_scatter on equal nodes): a named codec is always used (the
  caller asked); ``auto`` uses :data:`AUTO_CODEC` where the model predicts it :data:`AUTO_MIN_GAIN`
  faster than the exact choice. ``MEMRT_COMPRESS`` alone never compresses a call: the callers that honour
  it (the DDP hook, FSDP2's reduce-scatter) pass it as ``compress``.
- :func:`decide` is how a call of the running job goes (what :mod:`memrt.comm.dispatch` asks): the
  model's pick, where it ties for all_gather / broadcast under ``auto`` the measured pick
  (:mod:`memrt.comm.measured_pick`; :func:`after_trials` once its trials ran), then the compression the
  call asked for. Its ``reason`` is the comm log's: the trials' outcome or the compression's, else "".

Predictions come from :func:`memrt.comm.costmodel.predict` with the links measured by :mod:`memrt.comm.probe`
(or conservative defaults before a probe). :func:`tier_bytes` is the one count of bytes sent per tier.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from memrt.comm import costmodel as cm
from memrt.comm.costmodel import predict
from memrt.comm.reduction import op_name

if TYPE_CHECKING:
    from memrt.comm.measured_pick import MeasuredPicks
    from memrt.comm.topology import Topology
    from memrt.config import MemrtConfig

__all__ = ["AUTO_CODEC", "AUTO_MIN_GAIN", "Decision", "after_trials", "choose", "decide", "element_size_of",
           "is_floating", "tier_bytes"]

logger = logging.getLogger(__name__)

AUTO_CODEC = "bf16"
"""The codec ``compress=auto`` may pick: a rounding of each value (relative error 2**-8), never int8's chunk-wide
quantization, which changes training beyond rounding and is only used when asked for by name."""
AUTO_MIN_GAIN = 0.10
"""``compress=auto`` compresses a call only when the cost model predicts it at least this much faster."""

_ELEMENT_SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_FLOATING = {"float64", "float32", "float16", "bfloat16"}
_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """How one call runs and why."""

    algorithm: str
    """flat | hier | off (off: torch.distributed's call, untouched)."""
    codec: str | None = None
    """Codec of the inter-node hop (bf16 | fp16 | int8; with hier only); None: exact."""
    predicted_seconds: float | None = None
    """Cost-model time of this algorithm and codec for the call, seconds; None where none was made."""
    reason: str = ""
    """One line: forced by which setting, the predicted times, the trials' or the compression's outcome."""
    candidates: dict[str, float] = field(default_factory=dict)
    """Every algorithm considered (by :attr:`label`) -> predicted seconds."""
    trial: tuple | None = None
    """Set on the first call of a tie (:mod:`memrt.comm.measured_pick`): time both algorithms first."""
    via: str | None = None
    """What carries the call when not memrt's torch groups: ``mpi`` (memrt's MPI backend); None otherwise."""

    @property
    def label(self) -> str:
        """The algorithm as the comm log prints it: ``hier``, ``hier+int8``, ``flat@mpi``."""
        return self.algorithm + (f"+{self.codec}" if self.codec else "") + (f"@{self.via}" if self.via else "")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def element_size_of(dtype: Any) -> int:
    """Bytes per element of a torch dtype or its name (4 when unknown)."""
    return _ELEMENT_SIZE.get(_dtype_name(dtype), 4)


def is_floating(dtype: Any) -> bool:
    """Whether a torch dtype (or a dtype's name) is a floating-point type."""
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point
    return _dtype_name(dtype) in _FLOATING


def _sum_like(reduce_op: Any) -> bool:
    try:
        return op_name(reduce_op) in ("SUM", "AVG")
    except ValueError:
        return False


def _codec_allowed(op: str, nodes: tuple[tuple[int, ...], ...], dtype: Any, reduce_op: Any) -> bool:
    """Whether ``op`` can carry a compressed inter-node hop: a floating-point SUM / AVG across several nodes
    (all_reduce; reduce_scatter on equal nodes)."""
    if op not in ("all_reduce", "reduce_scatter") or len(nodes) < 2:
        return False
    if op == "reduce_scatter" and len({len(n) for n in nodes}) != 1:
        return False
    return is_floating(dtype) and _sum_like(reduce_op)


def choose(op: str, nbytes: int, dtype: Any, topology: Topology, config: MemrtConfig | None = None, *,
           compress: str | None = None, model: cm.LinkModel | None = None, reduce_op: Any = None,
           backend: str = "gloo", src: int = 0) -> Decision:
    """The cost model's pick for one collective (see module docstring); ``config`` None: ``MEMRT_COMM=auto``.

    Candidates flat and hier (all_gather / reduce_scatter have a hierarchical path on equal nodes only);
    MEMRT_COMM forces one, ``auto`` takes the smallest predicted time; then ``compress`` (None / "none":
    exact). ``topology`` needs ``nodes`` (and ``links`` when ``model`` is None)."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not valid: expected one of {', '.join(_OPS)}")
    nodes = tuple(tuple(n) for n in topology.nodes)
    mode = config.comm if config is not None else "auto"
    links, measured = cm.link_model_of(topology, model)
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
    times = times_of(["flat", "hier"])
    if mode == "off":
        return Decision(algorithm="flat", predicted_seconds=times["flat"], reason="MEMRT_COMM=off: torch.distributed",
                        candidates=times)
    if mode in ("flat", "hier"):
        exact = Decision(algorithm=mode, predicted_seconds=times[mode], reason=f"forced by MEMRT_COMM={mode}",
                         candidates=times)
    else:
        best = min(times, key=times.get)
        others = ", ".join(f"{a} {times[a] * 1e3:.3g} ms" for a in times if a != best)
        src_note = "" if measured else " (default links: not probed yet)"
        exact = Decision(algorithm=best, predicted_seconds=times[best], candidates=times, reason=(
            f"auto: {op} {best} predicted {times[best] * 1e3:.3g} ms <= {others} ({size}){src_note}"))
    if compress in (None, "none") or not _codec_allowed(op, nodes, dtype, reduce_op):
        return exact
    return _with_codec(exact, compress, op, nbytes, dtype, nodes, links, measured, mode)


def _with_codec(exact: Decision, asked: str, op: str, nbytes: int, dtype: Any, nodes: tuple[tuple[int, ...], ...],
                links: cm.LinkModel, measured: bool, mode: str) -> Decision:
    """``exact`` once the caller's ``asked`` (a codec name or "auto") is resolved for a compressible call."""
    esize = element_size_of(dtype)
    if asked != "auto":
        t = predict("hier", nbytes, nodes, links, esize, codec=asked, op=op)
        return Decision(algorithm="hier", codec=asked, predicted_seconds=t,
                        candidates={**exact.candidates, f"hier+{asked}": t},
                        reason=f"compress={asked} asked for: inter-node hop compressed")
    if mode == "flat":
        return dataclasses.replace(exact, reason="compress=auto: exact, MEMRT_COMM=flat forces torch's ring")
    base = exact.predicted_seconds
    if base is None:
        base = predict("flat" if exact.algorithm == "flat" else "hier", nbytes, nodes, links, esize, op=op)
    t = predict("hier", nbytes, nodes, links, esize, codec=AUTO_CODEC, op=op)
    gain = 1.0 - t / base if base > 0 else 0.0
    src = "" if measured else ", default links: not probed yet"
    line = (f"hier+{AUTO_CODEC} predicted {t * 1e3:.3g} ms vs {exact.label} {base * 1e3:.3g} ms ({gain:+.0%}; "
            f"{nbytes} B {_dtype_name(dtype)}{src})")
    if gain >= AUTO_MIN_GAIN:
        return Decision(algorithm="hier", codec=AUTO_CODEC, predicted_seconds=t,
                        candidates={**exact.candidates, f"hier+{AUTO_CODEC}": t},
                        reason=f"compress=auto: {line} >= {AUTO_MIN_GAIN:.0%}")
    return dataclasses.replace(exact, reason=f"compress=auto: exact, {line} < {AUTO_MIN_GAIN:.0%}")


def decide(op: str, nbytes: int, dtype: Any, topology: Topology, config: MemrtConfig, *, compress: str | None = None,
           compressible: bool = True, reduce_op: Any = None, backend: str = "gloo", src: int = 0,
           picks: MeasuredPicks | None = None, hier_ready: bool = True) -> Decision:
    """How one call of the running job goes: ``off`` under ``MEMRT_COMM=off``; flat (no prediction) where the
    hierarchical path cannot run (one node, one rank per node, ``hier_ready`` False: no tier groups); else
    :func:`choose`'s pick, under ``auto`` for all_gather / broadcast the measured pick of ``picks`` where the
    model ties (``trial`` set on the first such call); then ``compress`` where the call can carry it
    (``compressible``: the op's own path can). ``reason`` is what the comm log records."""
    if config.comm == "off":
        return Decision(algorithm="off")
    if topology.hierarchical_useful and hier_ready:
        pick = choose(op, nbytes, dtype, topology, config, reduce_op=reduce_op, backend=backend, src=src)
        logger.debug("%s %d B: %s (%s)", op, nbytes, pick.label, pick.reason)
        if config.comm == "auto" and picks is not None:
            algorithm, trial = picks.choose(op, nbytes, pick.candidates, pick.algorithm, src=src)
            predicted = pick.candidates.get(algorithm, pick.predicted_seconds)
            exact = Decision(algorithm=algorithm, predicted_seconds=predicted, reason=picks.reason(op, nbytes, src),
                             candidates=pick.candidates, trial=trial)
        else:
            exact = Decision(algorithm=pick.algorithm, predicted_seconds=pick.predicted_seconds,
                             candidates=pick.candidates)
    else:
        exact = Decision(algorithm="flat")
    nodes = tuple(tuple(n) for n in topology.nodes)
    if compress in (None, "none") or not (compressible and hier_ready and _codec_allowed(op, nodes, dtype, reduce_op)):
        return exact
    links, measured = cm.link_model_of(topology)
    return _with_codec(exact, compress, op, nbytes, dtype, nodes, links, measured, config.comm)


def after_trials(decision: Decision, picks: MeasuredPicks) -> Decision:
    """``decision`` once its trials have run (``picks`` settled ``decision.trial``): the measured pick, its
    prediction and the trials' outcome as the reason."""
    if decision.trial is None:
        return decision
    op, size, src = decision.trial
    algorithm, _ = picks.choose(op, size, decision.candidates, decision.algorithm, src=src)
    return dataclasses.replace(decision, algorithm=algorithm, predicted_seconds=picks.predicted(decision.trial),
                               reason=picks.reason(op, size, src), trial=None)


def tier_bytes(algorithm: str, nbytes: int, nodes: tuple[tuple[int, ...], ...], rank: int,
               element_size: int = 4, *, op: str = "all_reduce", codec: str | None = None) -> dict[str, int]:
    """Bytes ``rank`` sends per tier for one ``op`` call of ``nbytes`` under ``algorithm`` (flat | off | hier,
    ``codec``: the inter hop's, hier only), for any rank-to-node layout (nodes of any size, ranks of a node need
    not be contiguous).

    ``nbytes`` is the user's tensor: the input for all_gather (one rank's block) and the full input for
    reduce_scatter. Flat = torch's ring in rank order: rank r sends to r+1 (mod p), so its bytes are
    inter-node exactly when r+1 is on another node; per-rank ring volumes (Thakur et al. 2005):
    all_reduce 2(p-1)/p n, all_gather (p-1) n, reduce_scatter (p-1)/p n, broadcast n (forwarded once).
    Hierarchical (k = ranks of this rank's node, m = nodes): all_reduce intra 2(k-1)/k n (reduce-scatter
    + all-gather), inter 2(m-1)/m n/k (this rank's 1/k of the node's share crosses in a ring over the
    nodes; compressed: the codec's wire ratio, one all-gather of the shard when m = 2); all_gather
    inter (m-1) n then intra (k-1) m n; reduce_scatter intra (k-1) m n/p then inter (m-1) n/p (compressed:
    times the codec's wire ratio);
    broadcast n on each tier.
    """
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
        wire = cm.compressed_ratio(codec, element_size) if codec else 1.0
        return {"intra": int((k - 1) * m * block), "inter": int((m - 1) * block * wire)}
    intra = int(2 * (k - 1) / k * nbytes) if k > 1 else 0
    shard = nbytes / k
    if not codec:
        inter = int(2 * (m - 1) / m * shard) if m > 1 else 0
    else:
        ratio = cm.compressed_ratio(codec, element_size)
        inter = int(shard * ratio * (1 if m == 2 else 2 * (m - 1) / m)) if m > 1 else 0
    return {"intra": intra, "inter": inter}
