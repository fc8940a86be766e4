"""``memrt.comm.explain()``: what each kind of call ran, how long it was predicted and measured to take.

One row per (op, size bucket, algorithm), built on :func:`memrt.profiling.comm_log.call_stats`: calls,
bytes sent per tier, predicted and measured mean time, algorithm bandwidth and bus bandwidth as nccl-tests
defines them (NVIDIA nccl-tests,
``doc/PERFORMANCE.md``): ``algbw = size / time`` and ``busbw = algbw * factor`` with
:func:`memrt.profiling.comm_log.busbw_factor` (the one rule of the project), where ``size`` is the
``nbytes`` of a ``CommRecord`` (nccl-tests' size) and ``n`` the ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from memrt.profiling.comm_log import busbw_factor, call_stats  # the one busbw rule (nccl-tests doc/PERFORMANCE.md)
from memrt.profiling.recorder import CommRecord
from memrt.sizes import format_bytes

__all__ = ["ExplainRow", "explain", "explain_rows", "busbw_factor", "size_bucket"]


def size_bucket(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (rows group calls of similar size)."""
    return 1 << max(0, math.ceil(math.log2(max(1, nbytes))))


@dataclass(kw_only=True, slots=True)
class ExplainRow:
    op: str
    """Collective name."""
    size_bucket_bytes: int
    """Calls with nbytes in (bucket/2, bucket]."""
    algorithm: str
    """What ran: flat, hier, hier+int8, ..."""
    calls: int
    """Number of calls."""
    bytes_total: int
    """Sum of the calls' tensor bytes."""
    tier_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sent per tier, summed over the calls."""
    predicted_seconds: float | None = None
    """Mean predicted time per call, seconds (None when no prediction was made)."""
    measured_seconds: float = 0.0
    """Mean measured time per call, seconds."""
    algbw_bytes_per_s: float = 0.0
    """Mean tensor bytes per call / mean measured seconds."""
    busbw_bytes_per_s: float = 0.0
    """algbw times the op's nccl-tests factor."""

    @property
    def predicted_over_measured(self) -> float | None:
        if self.predicted_seconds is None or self.measured_seconds <= 0:
            return None
        return self.predicted_seconds / self.measured_seconds


def explain_rows(records: Iterable[Any]) -> list[ExplainRow]:
    """Group CommRecords (objects or their JSON dicts) into :class:`ExplainRow`s, each the
    :func:`memrt.profiling.comm_log.call_stats` of its calls."""
    groups: dict[tuple, list[Any]] = {}
    for r in records:
        r = asdict(r) if isinstance(r, CommRecord) else r
        groups.setdefault((r["op"], size_bucket(int(r.get("nbytes", 0))), r.get("algorithm")), []).append(r)
    rows = []
    for (op, bucket, algo), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        s = call_stats(rs)
        rows.append(ExplainRow(op=op, size_bucket_bytes=bucket, algorithm=algo, calls=s.calls, bytes_total=s.bytes_total,
                               tier_bytes=s.tier_bytes_total, predicted_seconds=s.predicted_seconds,
                               measured_seconds=s.mean_seconds, algbw_bytes_per_s=s.algbw if s.mean_seconds > 0 else 0.0,
                               busbw_bytes_per_s=s.busbw if s.mean_seconds > 0 else 0.0))
    return rows


def explain(records: Iterable[Any] | None = None, *, as_dict: bool = False) -> str | list[dict[str, Any]]:
    """A table of this process's collectives (default: the process recorder), or its rows as dicts."""
    if records is None:
        from memrt.profiling.recorder import get_recorder

        records = list(get_recorder().comm)
    rows = explain_rows(records)
    if as_dict:
        return [asdict(r) | {"predicted_over_measured": r.predicted_over_measured} for r in rows]
    head = ("op", "size<=", "algorithm", "calls", "intra sent", "inter sent", "predicted", "measured", "pred/meas",
            "algbw", "busbw")
    lines = [head]
    for r in rows:
        ratio = r.predicted_over_measured
        lines.append((r.op, format_bytes(r.size_bucket_bytes), r.algorithm, str(r.calls),
                      format_bytes(r.tier_bytes.get("intra", 0)), format_bytes(r.tier_bytes.get("inter", 0)),
                      "-" if r.predicted_seconds is None else f"{r.predicted_seconds * 1e3:.3g} ms",
                      f"{r.measured_seconds * 1e3:.3g} ms", "-" if ratio is None else f"{ratio:.2f}",
                      f"{format_bytes(r.algbw_bytes_per_s)}/s", f"{format_bytes(r.busbw_bytes_per_s)}/s"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("algbw = size / time, busbw = algbw * 2(n-1)/n for all_reduce (nccl-tests doc/PERFORMANCE.md)")
    return "\n".join(out)
