"""Certification of the plan in force under :func:`memrt.auto`: measure a step, and re-plan after an overshoot.

A plan is certified on its first step in this process, on a step that switches to it from another shape
(fixed shapes) and, once shapes vary, on every step with a dimension larger than those measured under it
(CUDA: allocator statistics; CPU: the tracker and the resident peak). Over the budget, the plan is remade
with the overshoot held back (:func:`held_back`), at most :data:`memrt.memory.replan.MAX_TRIES` plans per key,
else :class:`memrt.BudgetError` reports what was measured. An overshoot only resident memory shows (the
tensors fit) that no plan removes keeps the plan in force with one warning. Compiled steps' trials (torch's
partitioner, the floor) are certified the same way (:mod:`memrt.memory.trials`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from memrt.errors import BudgetError
from memrt.memory.buckets import grows
from memrt.memory.inforce import PlanInForce, record_plan
from memrt.memory.meter import Meter, known_tensors, make_meter, resident_bytes
from memrt.memory.planner import Plan
from memrt.memory.replan import MAX_TRIES, PlanMaker
from memrt.memory.steps import StepTracker
from memrt.memory.trees import tensor_leaves
from memrt.memory.trials import CompiledTrials

if TYPE_CHECKING:
    from memrt.memory.cache import CacheEntry
    from memrt.memory.instrument import Instrumentation

__all__ = ["Certifier", "Reading", "held_back", "memory_baseline", "missed_by", "overshoot_margin"]

logger = logging.getLogger("memrt.memory.auto")  # memrt.auto's messages keep their logger


@dataclass(frozen=True, slots=True)
class Reading:
    """What a measured step's meter read at its end."""

    measured: int
    """The step's peak, bytes: the higher of the tensor count and the resident peak where one was read."""
    counted: int
    """The tensor count's peak, bytes."""
    live: int
    """Bytes of tensors live at the end."""
    valid: bool
    """False when torch compiled during the step (it is measured again)."""


class Certifier:
    """Measures steps under the plan in force and certifies it, re-planning after an overshoot."""

    def __init__(self, model: nn.Module, inst: Instrumentation, *, device: torch.device, budget: int | None,
                 baseline: tuple[int | None, int], steps: StepTracker, inforce: PlanInForce, maker: PlanMaker,
                 trials: CompiledTrials) -> None:
        self._model = weakref.ref(model)
        self.inst = inst
        self.device = device
        self.budget = budget
        self.steps = steps
        self.inforce = inforce
        self.maker = maker
        self.trials = trials
        self.meter: Meter | None = None
        """The meter of the step being measured (None: this step is not measured)."""
        self.rss0, self.live0 = baseline
        """Resident bytes of the process (CPU; else None) and bytes of the model's tensors at ``memrt.auto``."""
        self.warned_untracked = False

    # -- measuring ---------------------------------------------------------------------------------------
    def maybe_measure(self, inputs: Any, *, switched: bool = False) -> None:
        """Certify the plan in force on this step: its first step in this process, a step that switches to
        it from another shape (fixed shapes), and once shapes vary, every step with a dimension larger than
        those measured under it."""
        entry = self.inforce.entry
        if self.meter is not None or entry is None:
            return
        if self.budget is None:  # no limit: record the memory timeline of one step per key, from the second
            if entry.measured_shapes is None and self.steps.step >= 2:
                self.start(inputs)
            return
        if switched or grows(self.steps.shapes, entry.measured_shapes):
            self.start(inputs)

    def start(self, inputs: Any) -> None:
        """Measure this step."""
        self.steps.backward_seen = False
        if self.inst.compiled_step:  # resident memory: the tracker does not see inductor's buffers
            from memrt.memory.compiled import compiled_meter

            self.meter = compiled_meter(self.device)
        else:
            self.meter = make_meter(self.device)
        self.meter.start(known_tensors(self._model(), tensor_leaves(inputs)))
        self.meter.mark("step_begin", "certify")

    def stop(self) -> Reading:
        """End the step's measurement (a meter must be running)."""
        meter, self.meter = self.meter, None
        measured = meter.peak
        meter.mark("step_end", "certify")
        live = meter.live()
        meter.stop()
        counted = measured
        resident = meter.resident_peak
        entry = self.inforce.entry
        if resident is not None and entry is not None:
            entry.plan.resident_peak_bytes = resident
            measured = max(measured, resident)  # what the user measures from outside counts too
        return Reading(measured=measured, counted=counted, live=live, valid=meter.valid)

    def close(self) -> None:
        if self.meter is not None:
            self.meter.stop()
            self.meter = None

    def note_untracked(self, live: int) -> None:
        """CPU: how much more resident memory the process gained since ``auto`` than its tensors did;
        one warning when that is over a twentieth of the budget (an outside peak would show it)."""
        entry = self.inforce.entry
        if self.rss0 is None or entry is None:
            return
        rss = resident_bytes()
        if rss is None:
            return
        untracked = max(0, (rss - self.rss0) - (live - self.live0))
        entry.plan.untracked_bytes = untracked
        if self.budget is not None and untracked > self.budget // 20 and not self.warned_untracked:
            self.warned_untracked = True
            logger.warning("memrt: this process's resident memory grew %.1f MiB more than the tensors memrt counts "
                           "for the step since memrt.auto (code and allocator memory of the first steps, buffers "
                           "outside torch, other objects the script made): "
                           "a peak RSS growth measured from outside a fresh process exceeds the step's tensor peak "
                           "by about that much (certification counts a step's own resident growth, not this)",
                           untracked / 2**20)

    # -- certifying --------------------------------------------------------------------------------------
    def certify(self, measured: int, counted: int | None = None) -> None:
        """``measured``: the step's peak (the higher of memrt's tensor count, ``counted``, and the resident
        peak where one was read)."""
        inforce = self.inforce
        entry = inforce.entry
        if entry is None:
            return
        p = entry.plan
        p.measured_peak_bytes = max(int(measured), p.measured_peak_bytes or 0)
        record_plan(p)
        if p.floor_trial and self.trials.floor_steps:  # a floor trial already read over the budget: its highest
            measured = p.measured_peak_bytes
        if self.budget is None or measured <= self.budget or p.outside_over_budget_bytes is not None:
            inforce.accept(inforce.key, entry, self.steps.shapes)
            return
        over = measured - self.budget
        if counted is not None and counted <= self.budget:  # only memory outside the tensors is over
            self._replan_for_outside(entry, measured, over)
            return
        if p.compiled_budget is not None:  # torch's partitioner missed: its overshoot held back once, then units
            retry = self.trials.partitioner_retry(inforce.key, p, entry.profile, measured, over,
                                                  overshoot_margin(p, measured, over))
            if retry is not None:
                inforce.use(retry, entry.profile, tries=p.tries + 1, scale=p.shape_scale)
            else:
                self.maker.make(entry.profile, margin=0, tries=1, scale=p.shape_scale)
            return
        if p.tries >= MAX_TRIES:
            if p.floor_trial:  # the compiled step's floor, measured (CompiledTrials.floor_plan)
                if self.trials.floor_missed():  # one more step under the floor: name the highest reading
                    return
                measured = p.measured_peak_bytes
            inforce.drop()
            if p.floor_trial:
                said = f" (the eager profile predicted {p.predicted_peak_bytes})" if p.predicted_peak_bytes else ""
                raise BudgetError(self.budget, measured, f"the compiled step with every unit recomputed "
                                  f"measured {measured} bytes{said}")
            raise BudgetError(self.budget, measured + p.margin_bytes,
                              f"measured peak {measured} bytes exceeds the budget by {over} bytes after "
                              f"{p.tries} plans (predicted {p.predicted_peak_bytes}); the error term of the "
                              f"memory model did not close")
        # The tensors are over: hold back the tensors' overshoot. A resident excess on top of it is judged
        # on the next step, once the tensors fit (resident growth of a step also holds first-use memory of
        # threads and buffers that no plan changes).
        tensors = measured if counted is None else counted
        logger.warning("memrt: measured peak %d bytes is %d over the budget; re-planning with that held back",
                       tensors, tensors - self.budget)
        self.maker.make(entry.profile, margin=held_back(p, self.budget, tensors, tensors - self.budget),
                        tries=p.tries + 1, scale=p.shape_scale)

    def _replan_for_outside(self, entry: CacheEntry, measured: int, over: int) -> None:
        """The tensors fit but resident memory does not: re-plan with the excess held back; when no plan
        fits that way (the excess is library scratch or allocator memory that no plan removes), keep the
        plan in force, record the excess and say so once, rather than leave the job with no plan."""
        p = entry.plan
        key = self.inforce.key
        logger.warning("memrt: this step's resident peak %d bytes is %d over the budget (memory outside torch's "
                       "tensors); re-planning with that held back", measured, over)
        try:
            self.maker.make(entry.profile, margin=held_back(p, self.budget, measured, over), tries=p.tries + 1,
                            scale=p.shape_scale)
        except BudgetError as exc:
            p.outside_over_budget_bytes = over
            self.inforce.keep(key, entry, self.steps.shapes)
            logger.warning("memrt: no plan keeps this step's resident memory under the budget (%s); keeping "
                           "the plan in force, whose tensors fit: the process's peak from outside stays about "
                           "%d bytes over. Raise MEMRT_BUDGET (or budget=) to at least %d bytes for a plan "
                           "that fits from outside", exc, over, exc.min_feasible_bytes)


def memory_baseline(model: nn.Module, device: torch.device) -> tuple[int | None, int]:
    """(resident bytes of the process on CPU, else None; bytes of ``model``'s parameters and buffers): what
    :meth:`Certifier.note_untracked` compares a certified step's end with."""
    rss0 = resident_bytes() if device.type == "cpu" else None
    live0 = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                 for t in list(model.parameters()) + list(model.buffers())}.values())
    return rss0, live0


def held_back(p: Plan, budget: int, measured: int, over: int) -> int:
    """Bytes the next unit plan holds back after ``p`` measured ``over`` bytes above ``budget``: the
    overshoot margin; where that leaves no feasible plan but the budget's room above the plan of least peak
    still holds the measured miss, that room (the plan of least peak is measured before the budget is
    called infeasible: only the margin's safety term stood in its way)."""
    room = budget - p.min_feasible_bytes
    margin = overshoot_margin(p, measured, over)
    return room if missed_by(p, measured, over) <= room < margin else margin


def overshoot_margin(p: Plan, measured: int, over: int) -> int:
    """Bytes to hold back when re-planning after ``p`` measured ``over`` bytes above the budget: the model's
    measured error for this plan (measured - predicted), not only the overshoot, since a plan predicted
    just inside budget - (margin + over) would be chosen again and miss by as much."""
    return missed_by(p, measured, over) + max(over // 8, 4096)


def missed_by(p: Plan, measured: int, over: int) -> int:
    """How far below the budget the next plan's prediction must be for ``p``'s measured error to fit."""
    return max(p.margin_bytes + over, measured - (p.predicted_peak_bytes or 0))
