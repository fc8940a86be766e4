"""The process-wide recorder: what memrt measures during a run, written per rank at the end.

Everything that measures (memory planner, offload engine, collectives) hands its records here;
:meth:`Recorder.write` puts them in one JSON file per rank that ``memrt report`` merges.
Recording is cheap (appending small dataclasses); it never synchronizes a device by itself.

Timing modes (see docs/sections/profiling.md): by default a collective on a CUDA tensor is timed with
a pair of CUDA events whose elapsed time is read lazily (when the events have completed, or once at
:meth:`Recorder.write`), so logging adds no device synchronize per call. ``exact_timing=True``
(:meth:`Recorder.configure`) synchronizes the device before and after each timed call instead: wall
times then include the queue wait, at the cost of serializing the host with the device.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CommRecord", "MemoryEvent", "TraceEvent", "Recorder", "get_recorder", "make_private_dir"]

SCHEMA_VERSION = 1
_RESOLVE_EVERY = 64
"""Try to resolve pending CUDA-event timings after this many new pending records (non-blocking)."""


@dataclass(slots=True)
class CommRecord:
    """One collective call."""

    op: str
    """Collective name: all_reduce, all_gather, reduce_scatter, broadcast, ..."""
    dtype: str
    """Element type, e.g. float32."""
    nbytes: int
    """nccl-tests' 'size' column: bytes of the full buffer (the user's tensor; all_gather: the gathered
    output, reduce_scatter: the input)."""
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
    redop: str = ""
    """Reduction (sum, avg, max, ...) for reducing collectives; empty otherwise (nccl-tests 'redop')."""
    reason: str = ""
    """Why this algorithm / codec was run, when a choice was made for the call (e.g. MEMRT_COMPRESS=auto)."""


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
        """False: every record_* call returns at once (profiling off)."""
        self.exact_timing = False
        """True: timed collectives synchronize the device before and after the call (see module doc)."""
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()
        """Wall clock (seconds since the epoch) at ``t0``: aligns ranks' timelines in a merged report."""
        self._pending: list[tuple[CommRecord, Any, Any]] = []
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

    def record_comm_pending(self, record: CommRecord, start_event: Any, end_event: Any) -> None:
        """Record ``record`` whose ``seconds`` is the elapsed time between two CUDA events, read later.

        Nothing waits here: completed pairs are resolved every few calls with ``Event.query()`` and the
        rest once in :meth:`write` (or :meth:`resolve_pending`).
        """
        if not self.enabled:
            return
        with self._lock:
            self.comm.append(record)
            self._pending.append((record, start_event, end_event))
            n = len(self._pending)
        if n % _RESOLVE_EVERY == 0:
            self.resolve_pending(block=False)

    def resolve_pending(self, *, block: bool = True) -> int:
        """Fill ``seconds`` of records timed by CUDA events; ``block`` waits for unfinished ones.

        Returns how many records remain pending.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        left = []
        for record, start_ev, end_ev in pending:
            if not block and not end_ev.query():
                left.append((record, start_ev, end_ev))
                continue
            end_ev.synchronize()
            record.seconds = start_ev.elapsed_time(end_ev) / 1e3  # elapsed_time is in milliseconds
        with self._lock:
            self._pending[:0] = left
            return len(self._pending)

    def configure(self, *, enabled: bool | None = None, exact_timing: bool | None = None) -> None:
        """Switch recording on/off and choose the timing mode (None leaves a setting unchanged)."""
        if enabled is not None:
            self.enabled = bool(enabled)
        if exact_timing is not None:
            self.exact_timing = bool(exact_timing)

    def add_plan(self, plan: Any) -> None:
        """Store a plan: a dict, a JSON string, or an object with ``to_json()`` / ``to_dict()``."""
        if hasattr(plan, "to_dict"):
            plan = plan.to_dict()
        elif hasattr(plan, "to_json"):
            plan = plan.to_json()
        if isinstance(plan, (str, bytes)):
            plan = json.loads(plan)
        with self._lock:
            self.plans.append(plan)

    def set_meta(self, **kv: Any) -> None:
        with self._lock:
            self.meta.update(kv)

    def to_dict(self, rank: int) -> dict[str, Any]:
        if self._pending:
            self.resolve_pending(block=True)
        with self._lock:
            return {
                "schema": SCHEMA_VERSION,
                "rank": rank,
                "pid": os.getpid(),
                "t0_unix": self.t0_unix,
                "t0_perf": self.t0,
                "meta": dict(self.meta),
                "plans": list(self.plans),
                "memory": [asdict(e) for e in self.memory],
                "comm": [asdict(r) for r in self.comm],
                "trace": [asdict(e) for e in self.trace],
            }

    def write(self, directory: str | os.PathLike, rank: int) -> Path:
        """Write ``rank{rank}.json`` into ``directory`` atomically; return its path.

        Folders memrt creates are 0700 and the file 0600: a report names hosts, paths and model shapes.
        """
        d = make_private_dir(directory)
        path = d / f"rank{rank}.json"
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.to_dict(rank), default=str))  # odd trace args become strings
        tmp.replace(path)
        return path

    def clear(self) -> None:
        with self._lock:
            self.comm.clear(); self.memory.clear(); self.trace.clear(); self.plans.clear(); self.meta.clear()
            self._pending.clear()
            self.t0 = time.perf_counter()
            self.t0_unix = time.time()


def make_private_dir(directory: str | os.PathLike, created: list[Path] | None = None) -> Path:
    """``directory`` with every folder this call creates made 0700 whatever the umask (existing ones are left
    as they are); the folders this call created are appended to ``created`` when given, outermost first."""
    d = Path(directory)
    missing = []
    cur = d
    while not cur.exists() and cur.parent != cur:
        missing.append(cur)
        cur = cur.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # another rank created it meanwhile
            continue
        os.chmod(folder, 0o700)
        if created is not None:
            created.append(folder)
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is not a directory")
    return d


_RECORDER = Recorder()


def get_recorder() -> Recorder:
    """The process-wide recorder."""
    return _RECORDER
