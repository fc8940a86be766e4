"""Step time per rank from what a rank file records today: step windows, collectives inside them, run totals.

A rank file has no step-time record of its own; what it does hold:

- **step windows**: ``memrt::step`` trace ranges (:class:`memrt.profiling.UnitMarker`), else the memory
  timeline's ``step_begin`` .. ``step_end`` (under ``MEMRT=1`` those are the planner's profile and certify
  steps, which run with measuring hooks: slower than ordinary steps);
- **collectives**: each call's start (``time.perf_counter()``, put on the recorder's clock with ``t0_perf``)
  and its time. A call is counted in the step its start falls in. On CPU backends (gloo, MPI) a call's time
  includes waiting for the other ranks; on CUDA it is the collective's time on its stream, which may overlap
  compute;
- **run totals** written by ``MEMRT=1``: the session's seconds and the steps the balance controller counted.

Waits for other ranks outside collectives (balance waits, data loading) are not recorded separately: they
are part of ``other_seconds``. Pure Python (no torch): ``memrt report`` uses it on loaded files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["StepSplit", "step_split"]

STEP_RANGE = "memrt::step"


@dataclass(kw_only=True, slots=True)
class StepSplit:
    """One rank's step time, split into what the rank file records."""

    rank: int
    source: str
    """Where the step windows came from: 'memrt::step ranges', 'memory timeline steps' or 'none'."""
    steps: int
    """Step windows measured."""
    step_seconds: float | None
    """Mean wall seconds of a step window; None without windows."""
    comm_seconds: float | None
    """Mean seconds per step window inside recorded collectives that started in it (host view; may overlap
    compute on CUDA); None when the file has no clock anchor (``t0_perf``)."""
    other_seconds: float | None
    """step_seconds - comm_seconds, at least 0: compute, data loading and waits not recorded separately."""
    comm_total_seconds: float
    """Sum of every recorded collective's time over the whole run."""
    run_seconds: float | None
    """Seconds of the MEMRT=1 session (process group start to exit: set-up included); None without MEMRT=1."""
    run_steps: int | None
    """Training steps the balance controller counted (MEMRT=1 with DDP); None when it did not run."""
    samples_per_s: float | None
    """This rank's speed in the last balance decision (samples per second of its own work); None without one."""

    @property
    def run_seconds_per_step(self) -> float | None:
        """run_seconds / run_steps: a whole-run mean, set-up and exit included."""
        if self.run_seconds is None or not self.run_steps:
            return None
        return self.run_seconds / self.run_steps


def _windows(data: Mapping[str, Any], memory_steps: list[Mapping[str, Any]]) -> tuple[str, list[tuple[float, float]]]:
    ranges = [(float(e["ts_us"]) / 1e6, (float(e["ts_us"]) + float(e["dur_us"])) / 1e6)
              for e in data.get("trace") or [] if e.get("name") == STEP_RANGE]
    if ranges:
        return "memrt::step ranges", sorted(ranges)
    spans = [(float(s["start_s"]), float(s["end_s"])) for s in memory_steps if s["end_s"] > s["start_s"]]
    return ("memory timeline steps", spans) if spans else ("none", [])


def _activation(data: Mapping[str, Any]) -> dict[str, Any]:
    activation = (data.get("meta") or {}).get("activation")
    return activation if isinstance(activation, dict) else {}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def step_split(data: Mapping[str, Any], memory_steps: list[Mapping[str, Any]]) -> StepSplit:
    """The step split of one loaded rank file; ``memory_steps`` is its timeline's steps (``StepMemory`` dicts)."""
    rank = int(data["rank"])
    source, windows = _windows(data, memory_steps)
    comm = data.get("comm") or []
    t0 = data.get("t0_perf")
    step_s = comm_s = other_s = None
    if windows:
        step_s = sum(end - start for start, end in windows) / len(windows)
        if _number(t0):
            inside = 0.0
            for record in comm:
                start = record.get("start")
                if not _number(start) or not start:
                    continue
                at = float(start) - float(t0)
                if any(lo <= at <= hi for lo, hi in windows):
                    inside += float(record["seconds"])
            comm_s = inside / len(windows)
            other_s = max(0.0, step_s - comm_s)
    activation = _activation(data)
    balance = activation.get("balance") if isinstance(activation.get("balance"), dict) else {}
    decisions = [d for d in balance.get("decisions") or [] if isinstance(d, dict)]
    speeds = decisions[-1].get("samples_per_s") if decisions else None
    speed = speeds[rank] if isinstance(speeds, list) and rank < len(speeds) and _number(speeds[rank]) else None
    run_s = activation.get("seconds")
    steps = balance.get("steps")
    return StepSplit(rank=rank, source=source, steps=len(windows), step_seconds=step_s, comm_seconds=comm_s,
                     other_seconds=other_s, comm_total_seconds=sum(float(r["seconds"]) for r in comm),
                     run_seconds=float(run_s) if _number(run_s) else None,
                     run_steps=int(steps) if isinstance(steps, int) and not isinstance(steps, bool) else None,
                     samples_per_s=float(speed) if speed is not None else None)
