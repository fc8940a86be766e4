"""The memory frontier of a profiled step: for a range of budgets, what memrt's planner would do and predict.

From one :class:`~memrt.memory.profile.Profile` (a training step profiled with every unit recomputed),
:func:`frontier` plans at each budget with :func:`memrt.memory.planner.plan` and reports the predicted step
peak, the time the plan adds to a step and the units kept, recomputed and offloaded; the smallest budget any
plan fits (:attr:`Frontier.min_feasible_bytes`) and the peak with everything kept close the range. ``memrt
plan`` prints it for a job's model (:mod:`memrt.activation.frontier`). The predictions are the planner's:
certification measures the step a plan then runs (docs/sections/memory.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from memrt.config import MemrtConfig
from memrt.errors import BudgetError
from memrt.memory import planner
from memrt.memory.profile import Profile
from memrt.sizes import format_bytes

__all__ = ["FrontierRow", "Frontier", "frontier", "spread_budgets", "DEFAULT_POINTS"]

DEFAULT_POINTS = 6
"""Budgets spread from the smallest feasible one to the keep-all peak when none are asked for."""


@dataclass(kw_only=True, slots=True)
class FrontierRow:
    """The plan at one budget."""

    budget_bytes: int
    feasible: bool
    """False when no plan fits the budget (below :attr:`Frontier.min_feasible_bytes`)."""
    predicted_peak_bytes: int | None = None
    added_seconds: float | None = None
    """Time the plan adds to a step (recomputation, copies not hidden), by the planner's model."""
    kept: int = 0
    recomputed: int = 0
    offloaded: int = 0
    """Unit calls per action."""


@dataclass(kw_only=True, slots=True)
class Frontier:
    """Plans of one profiled step at several budgets (see the module docstring)."""

    keep_all_peak_bytes: int
    """Predicted step peak with every unit kept (the job without memrt)."""
    min_feasible_bytes: int
    """The smallest budget some plan fits."""
    step_seconds: float
    """The step with every unit kept, estimated: the profiled step less its recomputation."""
    units: int
    """Unit calls the planner decides for."""
    rows: list[FrontierRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """One line per budget: budget, predicted peak, added ms and % of the step, kept / recomputed / offloaded."""
        lines = [f"{'budget':>11} {'pred. peak':>11} {'added ms':>9} {'added %':>8}  kept / recomputed / offloaded"]
        for r in self.rows:
            if not r.feasible:
                lines.append(f"{format_bytes(r.budget_bytes):>11} {'-':>11} {'-':>9} {'-':>8}  no plan fits "
                             f"(smallest: {format_bytes(self.min_feasible_bytes)})")
                continue
            share = 100 * r.added_seconds / self.step_seconds if self.step_seconds > 0 else 0.0
            lines.append(f"{format_bytes(r.budget_bytes):>11} {format_bytes(r.predicted_peak_bytes):>11} "
                         f"{r.added_seconds * 1e3:>9.2f} {share:>7.1f}%  {r.kept} / {r.recomputed} / {r.offloaded}")
        lines.append(f"keep everything: peak {format_bytes(self.keep_all_peak_bytes)}, step "
                     f"{self.step_seconds * 1e3:.1f} ms; smallest feasible budget {format_bytes(self.min_feasible_bytes)}")
        return "\n".join(lines)


def spread_budgets(low: int, high: int, points: int = DEFAULT_POINTS) -> list[int]:
    """``points`` budgets from ``low`` to ``high`` (both included), evenly spaced."""
    if points < 2 or high <= low:
        return [int(high)]
    return [int(low + (high - low) * i / (points - 1)) for i in range(points)]


def frontier(profile: Profile, budgets: Sequence[int] | None = None, *, offload: str | None = None,
             config: MemrtConfig | None = None, points: int = DEFAULT_POINTS) -> Frontier:
    """The planner's plan at each budget of ``budgets`` (bytes; default :func:`spread_budgets` from the smallest
    feasible budget to the keep-all peak) for ``profile``, with the same offload tiers and settings as a run."""
    keep = planner.plan(profile, None, offload=offload, config=config)
    floor = planner.recompute_all_plan(profile)
    step = max(0.0, profile.step_seconds - floor.added_seconds)
    out = Frontier(keep_all_peak_bytes=keep.keep_all_peak_bytes, min_feasible_bytes=keep.min_feasible_bytes,
                   step_seconds=step, units=len(profile.units))
    if budgets is None:
        budgets = spread_budgets(keep.min_feasible_bytes, keep.keep_all_peak_bytes, points)
    for b in sorted({int(b) for b in budgets}):
        try:
            p = planner.plan(profile, b, offload=offload, config=config)
        except BudgetError:
            out.rows.append(FrontierRow(budget_bytes=b, feasible=False))
            continue
        actions = [u.action for u in p.units]
        offloaded = sum("offload" in a for a in actions)
        recomputed = sum("recompute" in a for a in actions) - sum("recompute" in a and "offload" in a for a in actions)
        out.rows.append(FrontierRow(budget_bytes=b, feasible=True, predicted_peak_bytes=p.predicted_peak_bytes,
                                    added_seconds=p.added_seconds, kept=actions.count("keep"),
                                    recomputed=recomputed, offloaded=offloaded))
    return out
