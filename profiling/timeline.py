"""Memory timeline and peak attribution from the recorder's memory events.

Events (``Recorder.record_memory(live_bytes, kind, label)``) are read with these conventions:

- ``step_begin`` / ``step_end``: a training step. The live bytes at ``step_begin`` are the step's
  **fixed bytes** (parameters, gradients kept between steps, optimizer state); everything above them
  during the step is **activation bytes** (saved activations and temporaries). A ``fixed_bytes`` entry
  in the run's meta overrides this.
- ``phase`` with label ``forward`` / ``backward`` / ``optimizer``: the phase starts.
- ``unit_begin`` / ``unit_end`` with label ``name`` or ``name@phase``: a unit's range. Without an
  explicit phase, a unit seen again in the same step is taken to be in backward.
- ``recompute`` / ``offload`` / ``prefetch``: memrt actions, marked on the plot and in traces;
  ``sample`` / ``peak``: plain points (a ``peak`` is a measured maximum since the previous point).

The peak is attributed to the innermost open unit (or ``(outside units)``) and the phase at that point.
Pure Python (no torch): ``memrt report`` uses it on loaded files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from memrt.sizes import format_bytes
from memrt.profiling.recorder import MemoryEvent

__all__ = ["ACTION_KINDS", "MemoryPoint", "MemoryTimeline", "PeakAttribution", "StepMemory",
           "analyze_memory", "format_memory_table"]

ACTION_KINDS = ("recompute", "offload", "prefetch")
OUTSIDE = "(outside units)"


@dataclass(kw_only=True, slots=True)
class MemoryPoint:
    """One event placed in context."""

    t_s: float
    """Seconds since the recorder started."""
    live_bytes: int
    kind: str
    label: str
    step: int
    """Step index (0-based); -1 before the first step_begin."""
    unit: str
    """Innermost open unit, or '(outside units)'."""
    phase: str
    """forward | backward | optimizer | '' (unknown)."""


@dataclass(kw_only=True, slots=True)
class PeakAttribution:
    """Where the highest live-bytes point happened and what it was made of."""

    live_bytes: int
    t_s: float
    step: int
    unit: str
    phase: str
    fixed_bytes: int
    """Live bytes at the start of that step (parameters, gradients, optimizer state)."""
    activation_bytes: int
    """live_bytes - fixed_bytes: activations and temporaries."""


@dataclass(kw_only=True, slots=True)
class StepMemory:
    """One training step's memory figures."""

    step: int
    start_s: float
    end_s: float
    fixed_bytes: int
    peak_bytes: int
    activation_peak_bytes: int
    peak_unit: str
    peak_phase: str
    actions: dict[str, int] = field(default_factory=dict)
    """Count of memrt actions (recompute/offload/prefetch) in the step."""


@dataclass(kw_only=True, slots=True)
class MemoryTimeline:
    points: list[MemoryPoint]
    steps: list[StepMemory]
    peak: PeakAttribution | None

    def to_dict(self, *, max_points: int | None = None) -> dict[str, Any]:
        pts = self.points
        if max_points is not None and len(pts) > max_points:
            stride = -(-len(pts) // max_points)
            peaks = {(s.step, s.peak_bytes) for s in self.steps}
            keep, seen = [], set()
            for i, p in enumerate(pts):  # every stride-th point, plus each step's peak point
                key = (p.step, p.live_bytes)
                is_peak = key in peaks and key not in seen
                if is_peak:
                    seen.add(key)
                if i % stride == 0 or is_peak:
                    keep.append(p)
            pts = keep
        return {"points": [asdict(p) for p in pts], "steps": [asdict(s) for s in self.steps],
                "peak": asdict(self.peak) if self.peak else None}


def _split_label(label: str) -> tuple[str, str]:
    name, sep, phase = label.rpartition("@")
    return (name, phase) if sep else (label, "")


def analyze_memory(events: Iterable[MemoryEvent | Mapping[str, Any]], *,
                   fixed_bytes: int | None = None) -> MemoryTimeline:
    """Timeline with steps, units and phases resolved; the peak attributed (see module doc)."""
    evs = [asdict(e) if isinstance(e, MemoryEvent) else dict(e) for e in events]
    evs.sort(key=lambda e: e["t"])
    has_steps = any(e["kind"] == "step_begin" for e in evs)
    step = -1 if has_steps else 0
    stack: list[str] = []
    seen: set[str] = set()
    phase = ""
    fixed = fixed_bytes if fixed_bytes is not None else (int(evs[0]["live_bytes"]) if evs and not has_steps else 0)
    points: list[MemoryPoint] = []
    steps: dict[int, StepMemory] = {}
    peak: PeakAttribution | None = None

    def step_record(t: float) -> StepMemory:
        if step not in steps:
            steps[step] = StepMemory(step=step, start_s=t, end_s=t, fixed_bytes=fixed, peak_bytes=0,
                                     activation_peak_bytes=0, peak_unit="", peak_phase="")
        return steps[step]

    for e in evs:
        kind, label, live, t = e["kind"], e.get("label", "") or "", int(e["live_bytes"]), float(e["t"])
        name, explicit = _split_label(label)
        unit = stack[-1] if stack else OUTSIDE
        if kind == "step_begin":
            step += 1
            stack, seen, phase = [], set(), "forward"
            fixed = fixed_bytes if fixed_bytes is not None else live
            unit = OUTSIDE
        elif kind == "phase":
            phase = label
        elif kind == "unit_begin":
            phase = explicit or ("backward" if name in seen else (phase or "forward"))
            seen.add(name)
            stack.append(name)
            unit = name
        elif kind == "unit_end":
            if explicit:
                phase = explicit
            unit = name
            if name in stack:
                del stack[len(stack) - 1 - stack[::-1].index(name)]
        elif kind in ACTION_KINDS and name and not stack:
            unit = name
        points.append(MemoryPoint(t_s=t, live_bytes=live, kind=kind, label=label, step=step, unit=unit, phase=phase))
        if step < 0:
            continue
        rec = step_record(t)
        rec.end_s = t
        if kind in ACTION_KINDS:
            rec.actions[kind] = rec.actions.get(kind, 0) + 1
        if live > rec.peak_bytes:
            rec.peak_bytes, rec.peak_unit, rec.peak_phase = live, unit, phase
            rec.activation_peak_bytes = max(0, live - rec.fixed_bytes)
        if peak is None or live > peak.live_bytes:
            peak = PeakAttribution(live_bytes=live, t_s=t, step=step, unit=unit, phase=phase,
                                   fixed_bytes=rec.fixed_bytes, activation_bytes=max(0, live - rec.fixed_bytes))
    return MemoryTimeline(points=points, steps=[steps[k] for k in sorted(steps)], peak=peak)


def format_memory_table(per_rank: Mapping[int, MemoryTimeline], *,
                        budget_bytes: int | Mapping[int, int | None] | None = None,
                        devices: Mapping[int, str] | None = None) -> str:
    """Per rank: peak, fixed vs activation bytes, its budget and the share of it used, device, where the peak was.

    ``budget_bytes`` is one budget for every rank or each rank's own (a share of ``85%`` is a different
    number of bytes on each rank's device); a rank without a budget shows ``-``.
    """
    budgets = budget_bytes if isinstance(budget_bytes, Mapping) else {r: budget_bytes for r in per_rank}
    devices = devices or {}
    rows = [f"{'rank':>4} {'steps':>5} {'peak':>11} {'fixed':>11} {'activation':>11} {'budget':>11} "
            f"{'budget use':>10}  {'device':<14} peak at"]
    for rank, tl in sorted(per_rank.items()):
        p = tl.peak
        device = str(devices.get(rank, "?"))
        if p is None:
            rows.append(f"{rank:>4} {len(tl.steps):>5}  (no memory events)  device {device}")
            continue
        budget = budgets.get(rank)
        use = f"{p.live_bytes / budget:>10.1%}" if budget else f"{'-':>10}"
        shown = format_bytes(budget) if budget else "-"
        rows.append(f"{rank:>4} {len(tl.steps):>5} {format_bytes(p.live_bytes):>11} {format_bytes(p.fixed_bytes):>11} "
                    f"{format_bytes(p.activation_bytes):>11} {shown:>11} {use}  {device:<14} "
                    f"step {p.step}, {p.unit}, {p.phase or '?'}")
    return "\n".join(rows)
