"""``memrt.auto(model, budget)``: profile step 1, plan, apply, certify on the next step.

A step is the span from one training forward of the model (grad enabled) to the end of the step of an
optimizer that owns its parameters (or, without one, to the next training forward): what runs between
the optimizer step and the next forward (evaluation, logging, another model) is not the step's. A
forward whose output gets no gradient before the next forward (a validation loss computed with grad
enabled) is not a step: its profile or measurement is dropped and the next forward takes its place;
forwards with grad disabled are never steps. For each input signature (shapes, dtypes): the first step
is profiled (every unit recomputed, so it needs no more memory than checkpointing every unit), the plan
is made at the start of the next step and is in force from then on; that step's peak is measured
(CUDA: allocator statistics; CPU: the tracker and the resident peak) and, over budget, the plan is
remade with the overshoot held back (at most ``MAX_TRIES`` plans), else :class:`memrt.BudgetError` reports
what was measured. A compiled step for which the eager profile's model finds no plan runs with every unit
recomputed once and is measured: inductor's graph may fit where the eager profile says it cannot. An
overshoot only resident memory shows (the tensors fit) that no plan removes keeps the plan in force with
one warning.
Plans are cached per (structure, input signature, dtype, device, budget).

When training steps come with different input shapes, plans are made per shape bucket
(:mod:`memrt.memory.buckets`): one profile per bucket, a plan that holds for the bucket's largest
shape, a step measured whenever its shape exceeds those measured in its bucket, one warning.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn

from memrt.config import Budget, MemrtConfig, load_config, parse_budget
from memrt.errors import BudgetError
from memrt.memory.apply import ApplyHandle
from memrt.memory.buckets import (Shape, bucket_shapes, grows, input_shapes, scale_profile, shape_scale, signature_of,
                                  widen)
from memrt.memory.cache import CacheEntry, PlanCache, cache_key, default_cache
from memrt.memory.compiled import GRAPH_BUDGET_TRIES, graph_budget_plan
from memrt.memory.meter import (Meter, device_capacity_bytes, known_tensors, make_meter, on_optimizer_step,
                                owns_parameters, resident_bytes, watch_optimizers)
from memrt.memory.planner import Plan, plan as make_plan, recompute_all_plan
from memrt.memory.profile import Profile, ProfileSession, UnitProfile, model_device
from memrt.memory.trees import tensor_leaves
from memrt.memory.units import expect_module, find_units, structure_key

__all__ = ["auto", "plan_of", "disable", "MAX_TRIES"]

logger = logging.getLogger(__name__)

MAX_TRIES = 3
"""Plans made per key before an overshoot of the budget is an error."""
FLOOR_STEPS = 2
"""Steps a compiled step's floor (every unit recomputed) is measured over before it is named: a peak above
the process's earlier high-water mark is read exactly, one below it from resident memory sampled every
millisecond, which can miss a short peak; the highest reading is named."""


class _State:
    def __init__(self, model: nn.Module, budget_bytes: int | None, *, units: Sequence[str] | None,
                 offload: str, cache: PlanCache, config: MemrtConfig) -> None:
        self._model = weakref.ref(model)
        self.budget = budget_bytes
        self.offload = offload
        self.config = config
        """The settings this model is planned and offloaded under (the offload folder, strict)."""
        self.cache = cache
        self.device = model_device(model)
        self.units = find_units(model, units)
        self.structure = structure_key(model, self.units)
        self.dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", "")
        self.key: str | None = None
        self.signature = ""
        """The signature the plan in force is keyed by (the bucket's bound once shapes vary)."""
        self.entry: CacheEntry | None = None
        self.session: ProfileSession | None = None
        self.meter: Meter | None = None
        self.step = 0
        self.param_ids = {id(p) for p in model.parameters()}
        self.shapes: list[Shape] = []
        """Input shapes of the current training forward."""
        self.trained_shapes: list[Shape] | None = None
        """Input shapes of the first step that got its backward."""
        self.varying = False
        """Whether training steps came with different input shapes (plans are then per shape bucket)."""
        self.seeds: dict[str, tuple[Profile, list[Shape]]] = {}
        """Profiles of exact shapes made before the shapes varied, by their bucket's signature."""
        self.backward_seen: bool | None = False
        """Whether backward reached the current step's output (None: the output has no tensor to watch)."""
        self.no_backward: dict[str, None] = {}
        """Signatures of profiled forwards that got no backward (evaluation shapes), oldest first, at most 16."""
        self.last_key: str | None = None
        self.watching: str | None = None
        """The signature of this forward when it is an evaluation shape (its backward is watched)."""
        self.provisional = False
        """Whether this forward switched to shape buckets (undone if it gets no backward)."""
        """The key of the last training step."""
        self._bwd_hook: Any = None
        self.unpartitioned: set[str] = set()
        """Keys whose compiled step missed the budget under the partitioner's plan: planned by units now."""
        self.partitioner_tries: dict[str, int] = {}
        """Partitioner plans made per key."""
        self.floor_steps = 0
        """Steps measured over the budget under the floor trial in force (its entry stays uncertified, so the
        next step is measured too)."""
        self.rss0 = resident_bytes() if self.device.type == "cpu" else None
        self.live0 = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                          for t in list(model.parameters()) + list(model.buffers())}.values())
        self.warned_untracked = False
        self.warned_unprofiled = False
        self.sharded = _has_fsdp(model)
        """FSDP2 modules run collectives and write gradients in any backward: no shadow profile beside a
        compiled step (the step's floor is measured instead, :meth:`_floor_unprofiled`)."""
        self.handle = ApplyHandle(model, None, units=units, offload_dir=config.offload_dir, on_step=self._on_step,
                                  on_other=self._on_other, on_output=self._on_output)
        if self.handle.inst.compiled_parts:  # planned and measured otherwise than its eager twin: its own plans
            self.structure += "+compiled"

    # -- step boundary ------------------------------------------------------------------------------
    def _on_step(self, args: tuple, kwargs: dict) -> None:
        self.step += 1
        self._close_previous(tensor_leaves((args, kwargs)))
        self.shapes = input_shapes(args, kwargs)
        exact = signature_of(self.shapes)
        if exact in self.no_backward:  # an evaluation shape: the plan in force serves it; watch for a backward
            self.watching = exact
            self.backward_seen = False
            return
        provisional = False
        if not self.varying and self.trained_shapes is not None and self.shapes != self.trained_shapes:
            # new shapes: buckets from now on, confirmed when this forward turns out to be a training step
            self.varying = provisional = True
        sig = signature_of(bucket_shapes(self.shapes) if self.varying else self.shapes)
        structure = self.structure
        if self.handle.inst.traced_step:  # plans of its own; dropout draws in training mode only
            structure += "+traced" + ("" if self._model().training else "+eval")
        key = cache_key(structure, sig, self.dtype, str(self.device), self.budget, self.offload)
        if key == self.key and self.entry is not None:
            self.provisional = provisional
            self._maybe_measure((args, kwargs), switched=provisional)
            return
        found = self.cache.get(key)
        self.provisional = provisional
        self.key, self.signature = key, sig
        self.entry = found
        if self.entry is not None:
            self.handle.set_plan(self.entry.plan)
            self._maybe_measure((args, kwargs), switched=not self.varying or provisional)
            return
        if self.budget is None:  # no limit: plan for speed, nothing to profile
            entry = CacheEntry(plan=Plan(budget_bytes=None, structure=self.structure, signature=sig,
                                         device=str(self.device)),
                               profile=Profile(device=str(self.device), structure=self.structure, signature=sig))
            self.cache.put(key, entry)
            self.entry = entry
            self.handle.set_plan(entry.plan)
            self._maybe_measure((args, kwargs))
            return
        seed = self.seeds.get(sig) if self.varying else None
        if seed is not None:  # this bucket's shape was profiled before the shapes varied
            profile, shapes = seed
            self._make_plan(profile, margin=0, tries=1, scale=shape_scale(shapes, bucket_shapes(self.shapes)))
            self._maybe_measure((args, kwargs))
            return
        if self.handle.inst.traced_step and not self.sharded and not self.handle.inst.units_in_graph:
            # profiled eagerly beside the compiled step
            from memrt.memory.compiled import shadow_profile

            profile = shadow_profile(self._model(), self.units, self.device, args, kwargs,
                                     lambda call: setattr(self.handle, "_override", call))
            profile.signature = sig
            self._make_plan(profile, margin=0, tries=1)
            return
        if self.handle.inst.traced_step or self.handle.inst.units_in_graph:  # no unit call runs outside a graph
            self._floor_unprofiled(sig)
            return
        # profile this step: every unit recomputed
        self.session = ProfileSession(self._model(), self.units, device=self.device)
        self.session.profile.signature = signature_of(self.shapes)
        self.handle._override = self.session.unit_call
        self.backward_seen = False
        self.session.begin((args, kwargs))

    def _maybe_measure(self, inputs: Any, *, switched: bool = False) -> None:
        """Certify the plan in force on this step: its first step in this process, a step that switches to
        it from another shape (fixed shapes), and once shapes vary, every step with a dimension larger
        than those measured under it."""
        entry = self.entry
        if self.meter is not None or entry is None:
            return
        if self.budget is None:  # no limit: record the memory timeline of one step per key, from the second
            if entry.measured_shapes is None and self.step >= 2:
                self._start_measure(inputs)
            return
        if switched or grows(self.shapes, entry.measured_shapes):
            self._start_measure(inputs)

    def freeze(self) -> None:
        """An optimizer owning the model's parameters has stepped: the step's measurement stops counting
        new tensors (frees still count, so a ``zero_grad`` before the next forward is seen); planning
        and certification follow at the next training forward, as without an optimizer."""
        meter = self.session.meter if self.session is not None else self.meter
        if meter is not None:
            meter.pause()

    # -- forwards outside a training step ------------------------------------------------------------
    def _on_output(self, output: Any) -> None:
        """Watch the training forward's output: a step whose output gets no gradient before the next
        forward (a validation loss computed with grad enabled) is not a training step."""
        if (self.session is None and self.meter is None and self.watching is None) or self._bwd_hook is not None:
            return
        outs = [t for t in tensor_leaves(output, into_mappings=True) if t.requires_grad]  # unregistered mappings too
        if not outs:
            self.backward_seen = None
            return
        ref = weakref.ref(self)

        def seen(_grads: Any) -> None:
            st = ref()
            if st is not None:
                st.backward_seen = True

        self._bwd_hook = torch.autograd.graph.register_multi_grad_hook(outs, seen, mode="any")

    def _on_other(self) -> None:
        """A forward with grad disabled: after the step's backward it ends the step's measurement (like an
        optimizer step); it is never a step itself."""
        if self.backward_seen and (self.session is not None or self.meter is not None):
            self.freeze()

    def _step_was_training(self) -> bool:
        seen = self.backward_seen is not False
        if self._bwd_hook is not None:
            self._bwd_hook.remove()
            self._bwd_hook = None
        self.backward_seen = False
        return seen

    def _close_previous(self, next_inputs: Sequence[torch.Tensor] = ()) -> None:
        if self.watching is not None:
            watched, self.watching = self.watching, None
            if self._step_was_training():  # that shape trains after all: plan it from its next step
                self.no_backward.pop(watched, None)
            return
        if self.session is not None:
            session, self.session = self.session, None
            self.handle._override = None
            profile = session.end(next_inputs)
            if not self._step_was_training():  # no backward: nothing learned, profile the next step
                self._not_a_step()
                return
            self.no_backward.pop(signature_of(self.shapes), None)
            scale = 1.0
            if self.varying:
                scale = shape_scale(self.shapes, bucket_shapes(self.shapes))
            else:  # the shapes may vary later: this profile then serves its bucket
                self.seeds[signature_of(bucket_shapes(self.shapes))] = (profile, list(self.shapes))
            self._note_shapes()
            self._make_plan(profile, margin=0, tries=1, scale=scale)
            return
        if self.meter is not None:
            meter, self.meter = self.meter, None
            measured = meter.peak
            meter.mark("step_end", "certify")
            live = meter.live()
            meter.stop()
            counted = measured
            resident = getattr(meter, "resident_peak", None)
            if resident is not None and self.entry is not None:
                self.entry.plan.resident_peak_bytes = resident
                measured = max(measured, resident)  # what the user measures from outside counts too
            if not self._step_was_training():  # no backward: measure the next step instead
                self._not_a_step(profiled=False)
                return
            if not getattr(meter, "valid", True):  # torch compiled during the step: measured again next step
                return
            self._note_shapes()
            self._note_untracked(live)
            self._certify(measured, counted)

    def _note_untracked(self, live: int) -> None:
        """CPU: how much more resident memory the process gained since ``auto`` than its tensors did;
        one warning when that is over a twentieth of the budget (an outside peak would show it)."""
        if self.rss0 is None or self.entry is None:
            return
        rss = resident_bytes()
        if rss is None:
            return
        untracked = max(0, (rss - self.rss0) - (live - self.live0))
        self.entry.plan.untracked_bytes = untracked
        if self.budget is not None and untracked > self.budget // 20 and not self.warned_untracked:
            self.warned_untracked = True
            logger.warning("memrt: this process's resident memory grew %.1f MiB more than the tensors memrt counts "
                           "for the step since memrt.auto (code and allocator memory of the first steps, buffers "
                           "outside torch, other objects the script made): "
                           "a peak RSS growth measured from outside a fresh process exceeds the step's tensor peak "
                           "by about that much (certification counts a step's own resident growth, not this)",
                           untracked / 2**20)

    def _not_a_step(self, *, profiled: bool = True) -> None:
        """The forward got no backward. Shapes it made look varying do not count. Profiled: remember its
        key (later forwards of that signature run under the plan in force until one of them is a training
        step) and profile the next step."""
        if self.provisional:
            self.varying = self.provisional = False
        if not profiled:
            return
        if self.shapes:
            self.no_backward[signature_of(self.shapes)] = None
            while len(self.no_backward) > 16:
                self.no_backward.pop(next(iter(self.no_backward)))
        self.key, self.entry = None, None
        previous = self.cache.get(self.last_key) if self.last_key is not None else None
        if previous is not None:  # back to the plan of the last training step
            self.key, self.entry = self.last_key, previous
            self.handle.set_plan(previous.plan)

    def _note_shapes(self) -> None:
        """A training step ran with ``self.shapes``: the first different shapes switch to shape buckets."""
        self.last_key = self.key
        if self.trained_shapes is None:
            self.trained_shapes = list(self.shapes)
        elif self.provisional:
            self.provisional = False
            logger.warning("memrt: input shapes vary between training steps (%s, then %s): planning per shape "
                           "bucket (every dimension rounded up to a power of two), each bucket profiled once",
                           signature_of(self.trained_shapes), signature_of(self.shapes))

    def _make_plan(self, profile: Profile, *, margin: int, tries: int, scale: float = 1.0) -> None:
        if self._partitioned(profile):
            p = graph_budget_plan(scale_profile(profile, scale), self.budget, margin)
            if p is not None:
                self._use_partitioner_plan(p, profile, tries=tries, scale=scale)
                return
        try:
            p = make_plan(scale_profile(profile, scale), self.budget, margin_bytes=margin, offload=self.offload,
                          config=self.config)
        except BudgetError:
            if scale > 1.0:  # the bucket's largest shape does not fit by the model: plan for the shape seen
                logger.warning("memrt: no plan fits %s (the largest shape of its bucket) under the budget; "
                               "planning for the profiled shape %s and certifying larger ones as they come",
                               self.signature, profile.signature)
                self._make_plan(profile, margin=margin, tries=tries, scale=1.0)
                return
            if self._try_floor_compiled(profile):
                return
            self.entry = None
            self.key = None
            self.handle.set_plan(None)
            raise
        self._use_plan(p, profile, tries=tries, scale=scale)

    def _partitioned(self, profile: Profile) -> bool:
        """Whether this step's plan may be torch's partitioner under a budget (memrt.memory.compiled): the model
        is compiled whole (its units' calls traced into its graph, profiled beside it) and its forward draws
        no random numbers."""
        inst = self.handle.inst
        return (self.budget is not None and inst.traced_step and not self.sharded and not inst.units_in_graph
                and profile.draws_random is False and self.key not in self.unpartitioned)

    def _try_floor_compiled(self, profile: Profile) -> bool:
        """A compiled step for which the eagerly profiled memory model finds no plan under the budget: run
        every unit recomputed once and let certification measure its compiled step. Inductor's graphs often
        need less than the eager profile says (fused kernels free intermediates sooner); and where the eager
        model keeps a unit for free (the last block, whose backward runs first), a compiled backward may
        recompute the other units while that unit's tensors are still held, so under compile recomputing every
        unit is the floor. If it does not fit, the BudgetError names its measured peak as the smallest
        feasible budget."""
        if not self.handle.inst.compiled_step or self.budget is None:
            return False
        p = recompute_all_plan(profile, self.budget)
        capacity = device_capacity_bytes(self.device)
        if capacity is not None and p.predicted_peak_bytes > capacity:  # not worth a try that may run out of memory
            return False
        logger.warning("memrt: the memory model predicts no plan under the budget %d bytes for this compiled step "
                       "(smallest %d bytes from the eager profile); measuring the compiled step with every unit "
                       "recomputed", self.budget, p.min_feasible_bytes)
        p.floor_trial = True
        self.floor_steps = 0
        self._use_plan(p, profile, tries=MAX_TRIES, scale=1.0)  # a miss is final: no plan saves more
        return True

    def _floor_unprofiled(self, sig: str) -> None:
        """Units whose calls run inside a compiled graph, where memrt's unit calls do not run, with no profile
        beside the step (an FSDP2 model compiled whole: such a profile would run FSDP2's collectives and
        gradient reduction; units compiled in place, ``block.compile()``): every unit is recomputed inside the
        graph and the compiled step measured (a miss is a BudgetError naming the measured peak)."""
        log = logger.info if self.warned_unprofiled else logger.warning
        self.warned_unprofiled = True
        log("memrt: this model's units run inside a compiled graph where memrt cannot profile them one by one (an "
            "FSDP2 model compiled whole, or blocks compiled in place with module.compile()); every unit is "
            "recomputed and the compiled step measured against the budget. Compile each block with "
            "torch.compile(block) (torchtitan's way) for a plan that keeps what fits")
        profile = Profile(device=str(self.device), structure=self.structure, signature=sig, unprofiled=True,
                          units=[UnitProfile(index=i, name=name, has_backward=True)
                                 for i, (name, _) in enumerate(self.units)])
        p = recompute_all_plan(profile, self.budget)
        p.floor_trial = True
        self.floor_steps = 0
        self._use_plan(p, profile, tries=MAX_TRIES, scale=1.0)

    def _use_partitioner_plan(self, p: Plan, profile: Profile, *, tries: int, scale: float) -> None:
        """:meth:`_use_plan` for a plan of torch's partitioner (:func:`graph_budget_plan`), counted per key."""
        self.partitioner_tries[self.key] = self.partitioner_tries.get(self.key, 0) + 1
        self._use_plan(p, profile, tries=tries, scale=scale)

    def _use_plan(self, p: Plan, profile: Profile, *, tries: int, scale: float) -> None:
        p.tries = tries
        p.shape_scale = scale
        p.signature = self.signature
        self.entry = CacheEntry(plan=p, profile=profile)
        self.cache.put(self.key, self.entry)
        self.handle.set_plan(p)
        _record(p)
        logger.info("memrt plan (try %d):\n%s", tries, p)

    def _certify(self, measured: int, counted: int | None = None) -> None:
        """``measured``: the step's peak (the higher of memrt's tensor count, ``counted``, and the resident
        peak where one was read)."""
        entry = self.entry
        if entry is None:
            return
        p = entry.plan
        p.measured_peak_bytes = max(int(measured), p.measured_peak_bytes or 0)
        _record(p)
        if p.floor_trial and self.floor_steps:  # a floor trial already read over the budget: its highest reading
            measured = p.measured_peak_bytes
        if self.budget is None or measured <= self.budget or p.outside_over_budget_bytes is not None:
            self._accept(self.key, entry)
            return
        over = measured - self.budget
        if counted is not None and counted <= self.budget:  # only memory outside the tensors is over
            self._replan_for_outside(entry, measured, over)
            return
        if p.compiled_budget is not None:  # torch's partitioner missed: its overshoot held back once, then units
            retry = None
            if self.partitioner_tries.get(self.key, 0) < GRAPH_BUDGET_TRIES:
                retry = graph_budget_plan(scale_profile(entry.profile, p.shape_scale), self.budget,
                                          _overshoot_margin(p, measured, over), missed=p.compiled_budget)
            then = "re-planning with that held back" if retry is not None else "planning the units' actions instead"
            logger.warning("memrt: the compiled step partitioned by torch under activation_memory_budget %s "
                           "measured %d bytes, %d over the budget; %s", p.compiled_budget, measured, over, then)
            if retry is not None:
                self._use_partitioner_plan(retry, entry.profile, tries=p.tries + 1, scale=p.shape_scale)
            else:
                self.unpartitioned.add(self.key)
                self._make_plan(entry.profile, margin=0, tries=1, scale=p.shape_scale)
            return
        if p.tries >= MAX_TRIES:
            if p.floor_trial:  # the compiled step's floor, measured (_try_floor_compiled)
                self.floor_steps += 1
                if self.floor_steps < FLOOR_STEPS:  # one more step under the floor: name the highest reading
                    return
                measured = p.measured_peak_bytes
            self.key, self.entry = None, None
            self.handle.set_plan(None)
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
        self._make_plan(entry.profile, margin=self._held_back(p, tensors, tensors - self.budget),
                        tries=p.tries + 1, scale=p.shape_scale)

    def _held_back(self, p: Plan, measured: int, over: int) -> int:
        """Bytes the next unit plan holds back after ``p`` measured ``over`` bytes above the budget: the
        overshoot margin; where that leaves no feasible plan but the budget's room above the plan of least peak
        still holds the measured miss, that room (the plan of least peak is measured before the budget is
        called infeasible: only the margin's safety term stood in its way)."""
        room = self.budget - p.min_feasible_bytes
        margin = _overshoot_margin(p, measured, over)
        return room if _missed_by(p, measured, over) <= room < margin else margin

    def _accept(self, key: Any, entry: CacheEntry) -> None:
        """The step under ``entry``'s plan is certified: its shapes are covered, the plan is cached."""
        entry.measured_shapes = widen(self.shapes, entry.measured_shapes)
        self.cache.put(key, entry)

    def _replan_for_outside(self, entry: CacheEntry, measured: int, over: int) -> None:
        """The tensors fit but resident memory does not: re-plan with the excess held back; when no plan
        fits that way (the excess is library scratch or allocator memory that no plan removes), keep the
        plan in force, record the excess and say so once, rather than leave the job with no plan."""
        p = entry.plan
        key = self.key
        logger.warning("memrt: this step's resident peak %d bytes is %d over the budget (memory outside torch's "
                       "tensors); re-planning with that held back", measured, over)
        try:
            self._make_plan(entry.profile, margin=self._held_back(p, measured, over), tries=p.tries + 1,
                            scale=p.shape_scale)
        except BudgetError as exc:
            p.outside_over_budget_bytes = over
            self.key, self.entry = key, entry
            self._accept(key, entry)
            self.handle.set_plan(p)
            _record(p)
            logger.warning("memrt: no plan keeps this step's resident memory under the budget (%s); keeping "
                           "the plan in force, whose tensors fit: the process's peak from outside stays about "
                           "%d bytes over. Raise MEMRT_BUDGET (or budget=) to at least %d bytes for a plan "
                           "that fits from outside", exc, over, exc.min_feasible_bytes)

    def _start_measure(self, inputs: Any) -> None:
        self.backward_seen = False
        if self.handle.inst.compiled_step:  # resident memory: the tracker does not see inductor's buffers
            from memrt.memory.compiled import compiled_meter

            self.meter = compiled_meter(self.device)
        else:
            self.meter = make_meter(self.device)
        self.meter.start(known_tensors(self._model(), tensor_leaves(inputs)))
        self.meter.mark("step_begin", "certify")

    def close(self) -> None:
        if self.session is not None:
            self.session.meter.stop()
            self.session = None
        if self.meter is not None:
            self.meter.stop()
            self.meter = None
        self._step_was_training()
        self.handle.remove()


def _overshoot_margin(p: Plan, measured: int, over: int) -> int:
    """Bytes to hold back when re-planning after ``p`` measured ``over`` bytes above the budget: the model's
    measured error for this plan (measured - predicted), not only the overshoot, since a plan predicted
    just inside budget - (margin + over) would be chosen again and miss by as much."""
    return _missed_by(p, measured, over) + max(over // 8, 4096)


def _missed_by(p: Plan, measured: int, over: int) -> int:
    """How far below the budget the next plan's prediction must be for ``p``'s measured error to fit."""
    return max(p.margin_bytes + over, measured - (p.predicted_peak_bytes or 0))


def _record(p: Plan) -> None:
    try:
        from memrt.profiling.recorder import get_recorder

        get_recorder().add_plan(p.to_dict())
    except Exception as exc:  # noqa: BLE001 - reporting must never break training
        logger.debug("could not record plan: %s", exc)


_STATES: "weakref.WeakKeyDictionary[nn.Module, _State]" = weakref.WeakKeyDictionary()


def _optimizer_stepped(opt: torch.optim.Optimizer) -> None:
    for st in list(_STATES.values()):
        if (st.session is not None or st.meter is not None) and owns_parameters(opt, st.param_ids):
            st.freeze()


def _resolve_budget(budget: Any, config: MemrtConfig, device: torch.device) -> int | None:
    b: Budget | None = parse_budget("budget", budget) if budget is not None else config.budget
    if b is None:
        return None
    return b.resolve(device_capacity_bytes(device))


def auto(model: nn.Module, budget: int | str | Budget | None = None, *, config: MemrtConfig | None = None,
         units: Sequence[str] | None = None, offload: str | None = None,
         cache_dir: str | os.PathLike | None = None, cache: PlanCache | None = None) -> nn.Module:
    """Keep ``model``'s training-step peak under ``budget``; returns the same model object.

    ``budget``: bytes, a size ("3GiB"), a share of the device ("60%"), or None (MEMRT_BUDGET, else no
    limit). ``units``: class names of the units (default: repeated blocks). ``offload``: none|auto|disk|host
    (default MEMRT_OFFLOAD). ``cache_dir``: also keep plans on disk there; ``cache``: a :class:`PlanCache`.
    """
    expect_module("memrt.auto", model)
    compiled, model = model, _uncompiled(model)  # torch.compile's wrapper: plan the model it compiles
    cfg = config if config is not None else load_config(warn_unknown=False)
    disable(model)
    watch_optimizers()
    on_optimizer_step(_optimizer_stepped)
    device = model_device(model)
    budget_bytes = _resolve_budget(budget, cfg, device)
    off = offload if offload is not None else cfg.offload
    if cache is None:
        cache = PlanCache(cache_dir) if cache_dir is not None else default_cache()
    _STATES[model] = _State(model, budget_bytes, units=units, offload=off, cache=cache, config=cfg)
    return compiled


def _has_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule is an FSDP2 module (``fully_shard``)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its forward is what the compiled graph traces), else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def plan_of(model: nn.Module) -> Plan | None:
    """The plan in force on ``model`` (None before the first plan or without memrt)."""
    st = _STATES.get(_uncompiled(expect_module("memrt.plan_of", model)))
    if st is not None:
        return st.entry.plan if st.entry is not None else None
    from memrt.memory.apply import _HANDLES

    h = _HANDLES.get(model)
    return h.plan if h is not None else None


def disable(model: nn.Module) -> nn.Module:
    """Remove every hook memrt installed on ``model`` (auto or apply); the model is as before."""
    outer, model = model, _uncompiled(expect_module("memrt.disable", model))
    st = _STATES.pop(model, None)
    if st is not None:
        st.close()
    from memrt.memory.apply import remove

    remove(model)
    return outer
