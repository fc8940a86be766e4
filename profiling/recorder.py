"""The process-wide recorder: what memrt measures during a run, written per rank at the end.

Everything that measures (memory planner, offload engine, collectives) hands its records here;
:meth:`Recorder.write` puts them in one JSON file per rank that ``memrt report`` merges.
Recording is cheap (appending small dataclasses); it never synchronizes a device by itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CommRecord", "MemoryEvent", "TraceEvent", "Recorder", "get_recorder"]

SCHEMA_VERSION = 1


@dataclass(slots=True)
class CommRecord:
    """One collective call."""

    op: str
    """Collective name: all_reduce, all_gather, reduce_scatter, broadcast, ..."""
    dtype: str
    """Element type, e.g. float32."""
    nbytes: int
    """Bytes of the user's tensor (the 'size' column of nccl-tests)."""
    group_size: int
    """Ranks taking part."""
    algorithm: str
    """flat, hier, hier+int8, ... (what memrt actually ran)."""
    seconds: float
    """Wall time of the call on this rank (enqueue to completion as observed; see docs on timing)."""
    tier_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sent per tier, e.g. {"intra": ..., "inter": ...}."""
    predicted_seconds: float | None = None
    """Cost model prediction, when one was made."""
    start: float = 0.0
    """time.perf_counter() at the call's start (for traces)."""


@dataclass(slots=True)
class MemoryEvent:
    """A point of the memory timeline."""

    t: float
    """Seconds since the recorder started."""
    live_bytes: int
    """Live tensor bytes on the device at that moment."""
    kind: str
    """sample | unit_begin | unit_end | recompute | offload | prefetch | step_begin | step_end | peak."""
    label: str = ""
    """Unit name or phase (forward/backward)."""


@dataclass(slots=True)
class TraceEvent:
    """A complete ('X') Chrome trace event, times in microseconds."""

    name: str
    ts_us: float
    dur_us: float
    tid: int = 0
    cat: str = "memrt"
    args: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Per-process store of records; thread-safe appends."""

    def __init__(self) -> None:
        self.enabled = True
        self.t0 = time.perf_counter()
        self.comm: list[CommRecord] = []
        self.memory: list[MemoryEvent] = []
        self.trace: list[TraceEvent] = []
        self.plans: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self._lock = threading.Lock()

    def record_comm(self, record: CommRecord) -> None:
        if self.enabled:
            with self._lock:
                self.comm.append(record)

    def record_memory(self, live_bytes: int, kind: str, label: str = "") -> None:
        if self.enabled:
            with self._lock:
                self.memory.append(MemoryEvent(time.perf_counter() - self.t0, int(live_bytes), kind, label))

    def record_trace(self, name: str, start: float, end: float, *, tid: int | None = None, **args: Any) -> None:
        """A range from perf_counter() ``start`` to ``end``."""
        if self.enabled:
            with self._lock:
                self.trace.append(TraceEvent(name, (start - self.t0) * 1e6, (end - start) * 1e6,
                                             tid if tid is not None else threading.get_ident() % 100000, args=args))

    def add_plan(self, plan: dict[str, Any]) -> None:
        with self._lock:
            self.plans.append(plan)

    def set_meta(self, **kv: Any) -> None:
        with self._lock:
            self.meta.update(kv)

    def to_dict(self, rank: int) -> dict[str, Any]:
        with self._lock:
            return {
                "schema": SCHEMA_VERSION,
                "rank": rank,
                "pid": os.getpid(),
                "meta": dict(self.meta),
                "plans": list(self.plans),
                "memory": [asdict(e) for e in self.memory],
                "comm": [asdict(r) for r in self.comm],
                "trace": [asdict(e) for e in self.trace],
            }

    def write(self, directory: str | os.PathLike, rank: int) -> Path:
        """Write ``rank{rank}.json`` into ``directory`` (created if needed) atomically; return its path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(rank)))
        tmp.replace(path)
        return path

    def clear(self) -> None:
        with self._lock:
            self.comm.clear(); self.memory.clear(); self.trace.clear(); self.plans.clear(); self.meta.clear()


_RECORDER = Recorder()


def get_recorder() -> Recorder:
    """The process-wide recorder."""
    return _RECORDER
