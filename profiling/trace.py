"""Named ranges and Chrome trace export.

``memrt_range("name")`` is a context manager and a decorator: it opens
``torch.profiler.record_function("memrt::name")`` when a torch profiler is running (so memrt's work
shows inside the user's own traces) and records a trace event in the memrt recorder when recording is
on. With neither active it costs two flag checks.

:func:`chrome_trace` turns loaded rank files into the Chrome trace event format (JSON object with
``traceEvents``; opens in https://ui.perfetto.dev and chrome://tracing): ``X`` events for ranges and
collectives, a ``C`` counter track for live memory bytes, ``i`` instants for memrt actions. pid is the
rank; ranks are aligned on the wall clock recorded in each file.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from memrt.profiling.recorder import get_recorder

__all__ = ["COMM_TID", "MEMORY_TID", "chrome_trace", "memrt_range", "profiler_on", "write_chrome_trace"]

COMM_TID = 90001
"""Thread id of the collectives track in exported traces."""
MEMORY_TID = 90002
"""Thread id of the memory counter/instant track."""

F = TypeVar("F", bound=Callable[..., Any])


def profiler_on() -> bool:
    """Whether a torch profiler is recording in this process (without importing torch)."""
    torch = sys.modules.get("torch")  # no torch imported -> no torch profiler can be running
    return torch is not None and torch._C._autograd._profiler_enabled()


class memrt_range:
    """``with memrt_range("offload.pack"):`` or ``@memrt_range("plan")``; ``args`` go into the trace."""

    __slots__ = ("name", "args", "_rf", "_start")

    def __init__(self, name: str, **args: Any) -> None:
        self.name = name if name.startswith("memrt::") else f"memrt::{name}"
        self.args = args
        self._rf = None
        self._start = None

    def __enter__(self) -> "memrt_range":
        if profiler_on():
            import torch

            self._rf = torch.autograd.profiler.record_function(self.name)
            self._rf.__enter__()
        self._start = time.perf_counter() if get_recorder().enabled else None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._start is not None:
            get_recorder().record_trace(self.name, self._start, time.perf_counter(), **self.args)
            self._start = None
        if self._rf is not None:
            self._rf.__exit__(exc_type, exc, tb)
            self._rf = None

    def __call__(self, fn: F) -> F:
        name, args = self.name, self.args

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with memrt_range(name, **args):  # a fresh range per call: safe under recursion and threads
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def chrome_trace(ranks: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Chrome trace (``{"traceEvents": [...]}``) of one loaded rank file or several (pid = rank)."""
    ranks = [ranks] if isinstance(ranks, Mapping) else list(ranks)
    aligned = bool(ranks) and all(r.get("t0_unix") for r in ranks)
    base = min(r["t0_unix"] for r in ranks) if aligned else 0.0
    events: list[dict[str, Any]] = []
    for data in ranks:
        pid = int(data.get("rank", 0))
        shift_us = (data["t0_unix"] - base) * 1e6 if aligned else 0.0
        t0_perf = data.get("t0_perf")

        def ev(**kw: Any) -> None:
            kw.setdefault("pid", pid)
            kw.setdefault("dur", 0)
            events.append(kw)

        ev(ph="M", name="process_name", ts=0, tid=0, args={"name": f"rank {pid}"})
        ev(ph="M", name="process_sort_index", ts=0, tid=0, args={"sort_index": pid})
        ev(ph="M", name="thread_name", ts=0, tid=COMM_TID, args={"name": "memrt comm"})
        ev(ph="M", name="thread_name", ts=0, tid=MEMORY_TID, args={"name": "memrt memory"})
        for t in data.get("trace", []):
            ev(ph="X", name=t["name"], cat=t.get("cat", "memrt"), ts=t["ts_us"] + shift_us, dur=max(t["dur_us"], 0.0),
               tid=int(t.get("tid", 0)), args=_json_safe(t.get("args", {})))
        for c in data.get("comm", []):
            if not c.get("start") or t0_perf is None:
                continue
            ev(ph="X", name=f"memrt::{c['op']}", cat="comm", ts=(c["start"] - t0_perf) * 1e6 + shift_us,
               dur=c["seconds"] * 1e6, tid=COMM_TID,
               args=_json_safe({"bytes": c["nbytes"], "dtype": c["dtype"], "algorithm": c["algorithm"],
                                "group_size": c["group_size"], "redop": c.get("redop", ""),
                                "tier_bytes": c.get("tier_bytes", {})}))
        for m in data.get("memory", []):
            ts = m["t"] * 1e6 + shift_us
            ev(ph="C", name="memrt live bytes", ts=ts, tid=MEMORY_TID, args={"live_bytes": m["live_bytes"]})
            if m["kind"] not in ("sample",):
                ev(ph="i", s="t", name=f"memrt::{m['kind']}" + (f" {m['label']}" if m.get("label") else ""),
                   cat="memory", ts=ts, tid=MEMORY_TID, args={"live_bytes": m["live_bytes"]})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "memrt", "t0_unix": base}}


def write_chrome_trace(path: str | os.PathLike, ranks: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> Path:
    """Write :func:`chrome_trace` of ``ranks`` to ``path`` atomically; return the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(ranks)))
    tmp.replace(path)
    return path
