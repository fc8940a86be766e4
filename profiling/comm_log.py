"""Per-collective records in nccl-tests terms: timing helper, summary table, straggler view.

Bandwidth definitions follow nccl-tests ``doc/PERFORMANCE.md``
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

- ``algbw = S / t`` where ``S`` is the size column (bytes) and ``t`` the time of one call;
- ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter,
  all-gather and all-to-all, ``1`` for broadcast, reduce and send/recv (n = ranks in the group).

As in nccl-tests, ``S`` for all-gather is the gathered (output) buffer and for reduce-scatter the
input buffer, i.e. the full buffer, not the per-rank shard. Bandwidths are printed in GB/s (1e9 B/s)
and times in microseconds, like nccl-tests. Time is the mean over calls (nccl-tests averages over
iterations); the merged table averages the ranks' means.

This module imports torch only inside :class:`timed` (``memrt report`` stays torch-free).
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from memrt.profiling.recorder import CommRecord, Recorder, get_recorder

__all__ = [
    "CallStats",
    "CommRow",
    "RankSpread",
    "Straggler",
    "busbw_factor",
    "call_stats",
    "format_comm_table",
    "format_straggler_table",
    "straggler_view",
    "summarize_comm",
    "timed",
]

_ITEMSIZE = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}


def busbw_factor(op: str, n: int) -> float:
    """busbw / algbw for collective ``op`` over ``n`` ranks: the project's one busbw rule.

    nccl-tests ``doc/PERFORMANCE.md`` (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)
    and its ``*GetBw`` functions: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter,
    all-gather and all-to-all, ``1`` for broadcast, reduce and send/recv. At n = 1 the all-reduce and
    gather/scatter factors are 0, as nccl-tests prints them: a one-rank group moves nothing over a bus.
    """
    if n <= 0:
        raise ValueError(f"group size must be >= 1, got {n}")
    key = op.lower()
    if "all_reduce" in key or "allreduce" in key:
        return 2.0 * (n - 1) / n
    if any(k in key for k in ("reduce_scatter", "reducescatter", "all_gather", "allgather", "all_to_all", "alltoall")):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv: every byte crosses one link once


def _short_dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _profiler_on() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch._C._autograd._profiler_enabled()


class timed:
    """Time the collective inside the ``with`` block and record it as a :class:`CommRecord`.

    ``tensor`` gives dtype and size (for all-gather pass the output, for reduce-scatter the input:
    nccl-tests' size is the full buffer), or pass ``nbytes``/``dtype``. ``group`` is the process group
    (None: the default group). CPU tensors (gloo, MPI) complete inside the call, so wall time is
    exact. CUDA tensors are timed with CUDA events read lazily (no synchronize) unless the recorder's
    ``exact_timing`` is on. For ``async_op=True`` calls, ``wait()`` inside the block.
    """

    __slots__ = ("op", "tensor", "group", "algorithm", "nbytes", "dtype", "redop", "tier_bytes",
                 "predicted_seconds", "group_size", "recorder", "_t0", "_events", "_rf", "_sync")

    def __init__(self, op: str, tensor: Any = None, group: Any = None, algorithm: str = "flat", *,
                 nbytes: int | None = None, dtype: Any = None, redop: Any = "",
                 tier_bytes: Mapping[str, int] | None = None, predicted_seconds: float | None = None,
                 group_size: int | None = None, recorder: Recorder | None = None) -> None:
        self.op, self.tensor, self.group, self.algorithm = op, tensor, group, algorithm
        self.nbytes, self.dtype, self.redop = nbytes, dtype, redop
        self.tier_bytes, self.predicted_seconds, self.group_size = tier_bytes, predicted_seconds, group_size
        self.recorder = recorder or get_recorder()
        self._events = None
        self._rf = None
        self._sync = None

    def __enter__(self) -> "timed":
        rec = self.recorder
        if not rec.enabled:
            self._t0 = None
            return self
        t = self.tensor
        if t is not None and getattr(t, "is_cuda", False):
            import torch

            if rec.exact_timing:
                self._sync = t.device
                torch.cuda.synchronize(t.device)
            else:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                self._events[0].record()
        if _profiler_on():
            import torch

            self._rf = torch.autograd.profiler.record_function(f"memrt::{self.op}")
            self._rf.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._t0 is None:
            return
        if self._events is not None:
            self._events[1].record()
        if self._sync is not None:
            import torch

            torch.cuda.synchronize(self._sync)
        end = time.perf_counter()
        if self._rf is not None:
            self._rf.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return  # a failed collective is not a timing
        record = self._make_record(end - self._t0)
        if self._events is not None:
            self.recorder.record_comm_pending(record, *self._events)
        else:
            self.recorder.record_comm(record)

    def _make_record(self, seconds: float) -> CommRecord:
        t = self.tensor
        nbytes = self.nbytes if self.nbytes is not None else (t.numel() * t.element_size() if t is not None else 0)
        dtype = _short_dtype(self.dtype if self.dtype is not None else (t.dtype if t is not None else "unknown"))
        n = self.group_size
        if n is None:
            dist = sys.modules.get("torch.distributed")
            n = dist.get_world_size(self.group) if dist is not None and dist.is_initialized() else 1
        redop = self.redop
        if redop and not isinstance(redop, str):  # torch ReduceOp / RedOpType
            redop = str(redop).rsplit(".", 1)[-1].lower()
        return CommRecord(op=self.op, dtype=dtype, nbytes=int(nbytes), group_size=int(n),
                          algorithm=self.algorithm, seconds=seconds, tier_bytes=dict(self.tier_bytes or {}),
                          predicted_seconds=self.predicted_seconds, start=self._t0, redop=redop or "")


@dataclass(kw_only=True, slots=True)
class CommRow:
    """One line of the summary: calls of one op/size/type/algorithm/group size."""

    op: str
    algorithm: str
    group_size: int
    size_bytes: int
    """nccl-tests 'size': bytes of the full buffer."""
    count: int
    """Elements (size / element size)."""
    dtype: str
    redop: str
    time_us: float
    """Mean time of one call, microseconds (merged: mean of the ranks' means)."""
    algbw_gbps: float
    """size / time, GB/s (1e9 bytes per second)."""
    busbw_gbps: float
    """algbw * busbw_factor(op, group_size), GB/s."""
    calls: int
    """Calls summed over the ranks merged."""
    ranks: int
    """Ranks that contributed."""
    predicted_us: float | None = None
    """Mean cost-model prediction, microseconds, when the calls carried one."""
    tier_bytes: dict[str, int] | None = None
    """Bytes per tier per call (mean over calls), when recorded."""


@dataclass(kw_only=True, slots=True)
class CallStats:
    """What a set of recorded calls of one op add up to; the rows of every comm table are built on it."""

    op: str
    calls: int
    bytes_total: int
    """Sum of the calls' nccl-tests sizes."""
    mean_seconds: float
    """Mean time of one call."""
    predicted_seconds: float | None
    """Mean cost-model prediction over the calls that carried one; None when none did."""
    tier_bytes_total: dict[str, int]
    """Bytes sent per tier, summed over the calls."""
    group_size: int
    """Largest group the calls ran over."""

    @property
    def algbw(self) -> float:
        """Mean size / mean time, bytes per second (inf for calls timed at 0)."""
        return self.bytes_total / self.calls / self.mean_seconds if self.mean_seconds > 0 else math.inf

    @property
    def busbw(self) -> float:
        """algbw times :func:`busbw_factor` of the op over the group."""
        return self.algbw * busbw_factor(self.op, self.group_size)


def call_stats(records: Iterable[Any]) -> CallStats:
    """:class:`CallStats` of CommRecords (objects or their JSON dicts) of one op; at least one record."""
    calls = _as_dicts(records)
    if not calls:
        raise ValueError("call_stats needs at least one record")
    preds = [float(r["predicted_seconds"]) for r in calls if r.get("predicted_seconds") is not None]
    tiers: dict[str, int] = defaultdict(int)
    for r in calls:
        for tier, nbytes in (r.get("tier_bytes") or {}).items():
            tiers[tier] += int(nbytes)
    return CallStats(op=calls[0]["op"], calls=len(calls), bytes_total=sum(int(r.get("nbytes", 0)) for r in calls),
                     mean_seconds=sum(float(r.get("seconds", 0.0)) for r in calls) / len(calls),
                     predicted_seconds=sum(preds) / len(preds) if preds else None, tier_bytes_total=dict(tiers),
                     group_size=max(int(r.get("group_size", 1)) for r in calls))


def _key(r: Mapping[str, Any]) -> tuple:
    return (r["op"], r.get("algorithm", ""), int(r.get("group_size", 1)), int(r["nbytes"]),
            _short_dtype(r.get("dtype", "")), r.get("redop", "") or "")


def _as_dicts(records: Iterable[Any]) -> list[dict[str, Any]]:
    return [asdict(r) if isinstance(r, CommRecord) else dict(r) for r in records]


def summarize_comm(per_rank: Mapping[int, Iterable[Any]] | Iterable[Any]) -> list[CommRow]:
    """Rows in nccl-tests order from one rank's records or ``{rank: records}`` (merged by mean)."""
    if not isinstance(per_rank, Mapping):
        per_rank = {0: per_rank}
    groups: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rank, records in per_rank.items():
        for r in _as_dicts(records):
            groups[_key(r)][rank].append(r)
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
        op, algo, n, nbytes, dtype, redop = key
        by_rank = groups[key]
        # merged: the mean of the ranks' means, so that a rank with more calls does not weigh more
        stats = call_stats([r for rs in by_rank.values() for r in rs])
        stats.mean_seconds = sum(call_stats(rs).mean_seconds for rs in by_rank.values()) / len(by_rank)
        rows.append(CommRow(op=op, algorithm=algo, group_size=n, size_bytes=nbytes,
                            count=nbytes // _ITEMSIZE.get(dtype, 1), dtype=dtype, redop=redop,
                            time_us=stats.mean_seconds * 1e6, algbw_gbps=stats.algbw / 1e9,
                            busbw_gbps=stats.busbw / 1e9, calls=stats.calls, ranks=len(by_rank),
                            predicted_us=stats.predicted_seconds * 1e6 if stats.predicted_seconds is not None else None,
                            tier_bytes={k: v // stats.calls for k, v in stats.tier_bytes_total.items()} or None))
    return rows


def format_comm_table(rows: Sequence[CommRow]) -> str:
    """nccl-tests style: one block per (op, algorithm, ranks); columns size count type redop time algbw busbw."""
    if not rows:
        return "(no collectives recorded)"
    out = []
    head = (f"{'size(B)':>12} {'count':>12} {'type':>9} {'redop':>6} {'time(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'calls':>6} {'pred(us)':>9}")
    current = None
    for r in rows:
        block = (r.op, r.algorithm, r.group_size)
        if block != current:
            current = block
            out.append(f"# {r.op}  algorithm={r.algorithm}  ranks={r.group_size}")
            out.append(head)
        pred = f"{r.predicted_us:9.1f}" if r.predicted_us is not None else f"{'-':>9}"
        out.append(f"{r.size_bytes:>12d} {r.count:>12d} {r.dtype:>9} {r.redop or '-':>6} {r.time_us:>10.1f} "
                   f"{r.algbw_gbps:>11.3f} {r.busbw_gbps:>11.3f} {r.calls:>6d} {pred}")
    return "\n".join(out)


@dataclass(kw_only=True, slots=True)
class RankSpread:
    """Per-rank time of one kind of call (op, size) across the ranks of a merged report."""

    op: str
    size_bytes: int
    algorithm: str
    mean_us_by_rank: dict[int, float]
    spread_us: float
    """max - min of the ranks' mean times."""
    spread_ratio: float
    """spread / max (0: balanced)."""


@dataclass(kw_only=True, slots=True)
class Straggler:
    """Arrival order at collectives: the rank that enters last makes the others wait."""

    rank: int
    total_comm_s: float
    """Sum of this rank's collective times (long = waited for others)."""
    calls: int
    last_arrivals: int
    """Calls (matched across ranks by order) this rank entered last."""
    mean_lateness_us: float
    """Mean of (this rank's entry - earliest entry), microseconds; needs synchronized wall clocks."""


def straggler_view(ranks: Sequence[Mapping[str, Any]]) -> tuple[list[RankSpread], list[Straggler]]:
    """From loaded rank files: per-(op, size) time spread, and per-rank arrival lateness.

    Calls are matched across ranks by their order within (op, size, algorithm, group size); entry
    times are put on one clock with each file's ``t0_unix``/``t0_perf`` (exact on one machine, clock
    sync error across machines).
    """
    by_key: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for data in ranks:
        for r in data.get("comm", []):
            by_key[_key(r)][int(data["rank"])].append(r)
    spreads = []
    late: dict[int, list[float]] = defaultdict(list)
    last: dict[int, int] = defaultdict(int)
    offsets = {int(d["rank"]): (d.get("t0_unix"), d.get("t0_perf")) for d in ranks}
    for key, by_rank in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][3])):
        if len(by_rank) < 2:
            continue
        means = {rk: sum(r["seconds"] for r in rs) / len(rs) * 1e6 for rk, rs in sorted(by_rank.items())}
        hi, lo = max(means.values()), min(means.values())
        spreads.append(RankSpread(op=key[0], size_bytes=key[3], algorithm=key[1], mean_us_by_rank=means,
                                  spread_us=hi - lo, spread_ratio=(hi - lo) / hi if hi > 0 else 0.0))
        if any(offsets[rk][0] is None or offsets[rk][1] is None for rk in by_rank):
            continue
        for i in range(min(len(rs) for rs in by_rank.values())):
            entry = {rk: offsets[rk][0] + (rs[i]["start"] - offsets[rk][1]) for rk, rs in by_rank.items()
                     if rs[i].get("start")}
            if len(entry) < 2:
                continue
            first = min(entry.values())
            for rk, t in entry.items():
                late[rk].append((t - first) * 1e6)
            last[max(entry, key=entry.get)] += 1
    stragglers = []
    for data in ranks:
        rk = int(data["rank"])
        comm = data.get("comm", [])
        lat = late.get(rk, [])
        stragglers.append(Straggler(rank=rk, total_comm_s=sum(r["seconds"] for r in comm), calls=len(comm),
                                    last_arrivals=last.get(rk, 0),
                                    mean_lateness_us=sum(lat) / len(lat) if lat else 0.0))
    return spreads, stragglers


def format_straggler_table(spreads: Sequence[RankSpread], stragglers: Sequence[Straggler]) -> str:
    if len(stragglers) < 2:
        return "(one rank: no straggler view)"
    out = [f"{'rank':>4} {'comm(s)':>9} {'calls':>6} {'last in':>7} {'late(us)':>9}"]
    for s in sorted(stragglers, key=lambda s: s.rank):
        out.append(f"{s.rank:>4d} {s.total_comm_s:>9.4f} {s.calls:>6d} {s.last_arrivals:>7d} {s.mean_lateness_us:>9.1f}")
    worst = max(stragglers, key=lambda s: (s.last_arrivals, s.mean_lateness_us))
    matched = sum(s.last_arrivals for s in stragglers)  # every matched call has one last rank
    # name a straggler only when it is last clearly more often than chance (1/n) would make it
    if matched and worst.last_arrivals / matched > 1 / len(stragglers) + 0.1:
        out.append(f"likely straggler: rank {worst.rank} (entered last in {worst.last_arrivals} of {matched} calls, "
                   f"{worst.mean_lateness_us:.1f} us late on average; the others wait for it)")
    elif matched:
        out.append(f"no clear straggler: the last rank to enter varies across {matched} calls")
    if spreads:
        out.append("")
        out.append(f"{'op':>16} {'size(B)':>10} {'algo':>6} {'min(us)':>9} {'max(us)':>9} {'spread':>7}")
        for s in spreads:
            vals = s.mean_us_by_rank.values()
            out.append(f"{s.op:>16} {s.size_bytes:>10d} {s.algorithm:>6} {min(vals):>9.1f} {max(vals):>9.1f} "
                       f"{s.spread_ratio:>7.1%}")
    return "\n".join(out)
