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

import os
import sys
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from memrt.config import Budget, MemrtConfig, load_config, parse_budget
from memrt.memory.apply import ApplyHandle, applied_plan
from memrt.memory.buckets import bucket_shapes, shape_scale, signature_of
from memrt.memory.cache import CacheEntry, PlanCache, cache_key, default_cache
from memrt.memory.certify import Certifier, memory_baseline
from memrt.memory.inforce import PlanInForce
from memrt.memory.meter import device_capacity_bytes, on_optimizer_step, owns_parameters, watch_optimizers
from memrt.memory.planner import Plan
from memrt.memory.profile import Profile, ProfileSession, model_device
from memrt.memory.replan import MAX_TRIES, PlanMaker
from memrt.memory.steps import StepTracker
from memrt.memory.trees import tensor_leaves
from memrt.memory.trials import CompiledTrials
from memrt.memory.units import expect_module, find_units, structure_key

__all__ = ["auto", "plan_of", "disable", "on_plan_error", "on_profiled", "MAX_TRIES"]

PlanErrorCallback = Callable[[Exception], None]
"""``callback(exc)``: what :func:`on_plan_error` calls with an error of planning raised during a training step."""
ProfileCallback = Callable[[Profile], None]
"""``callback(profile)``: what :func:`on_profiled` calls with each profile of a training step."""


class _State:
    """memrt.auto on one model: its step hooks, wired to the parts that keep each account (which step it is at,
    :class:`StepTracker`; the plan in force and the plans per key, :class:`PlanInForce`; making plans,
    :class:`PlanMaker`; compiled steps' trials, :class:`CompiledTrials`; measuring and certifying steps,
    :class:`Certifier`)."""

    def __init__(self, model: nn.Module, budget_bytes: int | None, *, units: Sequence[str] | None,
                 offload: str, cache: PlanCache, config: MemrtConfig) -> None:
        self._model = weakref.ref(model)
        self.budget = budget_bytes
        self.offload = offload
        self.device = model_device(model)
        self.units = find_units(model, units)
        self.structure = structure_key(model, self.units)
        self.dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", "")
        self.param_ids = {id(p) for p in model.parameters()}
        self.session: ProfileSession | None = None
        """The profile of this step, while one is made."""
        self.on_error: PlanErrorCallback | None = None
        self.on_profile: ProfileCallback | None = None
        """Where planning errors of a training step go (:func:`on_plan_error`); None: raised from the forward."""
        self.steps = StepTracker()
        sharded = _has_fsdp(model)
        baseline = memory_baseline(model, self.device)  # before memrt's hooks exist
        self.handle = ApplyHandle(model, None, units=units, offload_dir=config.offload_dir, on_step=self._step,
                                  on_other=self._on_other, on_output=self._on_output)
        if self.handle.inst.compiled_parts:  # planned and measured otherwise than its eager twin: its own plans
            self.structure += "+compiled"
        self.inforce = PlanInForce(cache, self.handle)
        self.trials = CompiledTrials(self.handle.inst, budget=budget_bytes, device=self.device, sharded=sharded)
        self.maker = PlanMaker(self.inforce, self.trials, budget=budget_bytes, offload=offload, config=config)
        self.certifier = Certifier(model, self.handle.inst, device=self.device, budget=budget_bytes,
                                   baseline=baseline, steps=self.steps, inforce=self.inforce, maker=self.maker,
                                   trials=self.trials)

    @property
    def entry(self) -> CacheEntry | None:
        """The cache entry of the plan in force."""
        return self.inforce.entry

    # -- step boundary ------------------------------------------------------------------------------
    def _step(self, args: tuple, kwargs: dict) -> None:
        """The model's step hook: :meth:`_on_step`, its errors passed to :attr:`on_error` where one is set."""
        if self.on_error is None:
            self._on_step(args, kwargs)
            return
        callback = self.on_error
        try:
            self._on_step(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the policy set with on_plan_error decides
            model = self._model()
            if model is not None:
                disable(model)
            callback(exc)

    def _on_step(self, args: tuple, kwargs: dict) -> None:
        steps, inforce = self.steps, self.inforce
        steps.step += 1
        self._close_previous(tensor_leaves((args, kwargs)))
        sig = steps.enter(args, kwargs)
        if sig is None:  # an evaluation shape: the plan in force serves it; its backward is watched
            return
        provisional = steps.provisional
        structure = self.structure
        if self.handle.inst.traced_step:  # plans of its own; dropout draws in training mode only
            structure += "+traced" + ("" if self._model().training else "+eval")
        key = cache_key(structure, sig, self.dtype, str(self.device), self.budget, self.offload)
        if key == inforce.key and inforce.entry is not None:
            self.certifier.maybe_measure((args, kwargs), switched=provisional)
            return
        if inforce.switch(key, sig) is not None:
            self.certifier.maybe_measure((args, kwargs), switched=not steps.varying or provisional)
            return
        if self.budget is None:  # no limit: plan for speed, nothing to profile
            inforce.put(CacheEntry(plan=Plan(budget_bytes=None, structure=self.structure, signature=sig,
                                             device=str(self.device)),
                                   profile=Profile(device=str(self.device), structure=self.structure, signature=sig)))
            self.certifier.maybe_measure((args, kwargs))
            return
        seed = inforce.seeds.get(sig) if steps.varying else None
        if seed is not None:  # this bucket's shape was profiled before the shapes varied
            profile, shapes = seed
            self.maker.make(profile, margin=0, tries=1, scale=shape_scale(shapes, bucket_shapes(steps.shapes)))
            self.certifier.maybe_measure((args, kwargs))
            return
        if self.trials.shadow_profiled():  # profiled eagerly beside the compiled step
            from memrt.memory.compiled import shadow_profile

            profile = shadow_profile(self._model(), self.units, self.device, args, kwargs, self.handle.override)
            profile.signature = sig
            self.maker.make(profile, margin=0, tries=1)
            return
        if self.handle.inst.traced_step or self.handle.inst.units_in_graph:  # no unit call runs outside a graph
            p, profile = self.trials.unprofiled_floor(self.units, self.structure, sig)
            inforce.use(p, profile, tries=MAX_TRIES, scale=1.0)
            return
        # profile this step: every unit recomputed
        self.session = ProfileSession(self._model(), self.units, device=self.device)
        self.session.profile.signature = signature_of(steps.shapes)
        self.handle.override(self.session.unit_call)
        steps.backward_seen = False
        self.session.begin((args, kwargs))

    def freeze(self) -> None:
        """An optimizer owning the model's parameters has stepped: the step's measurement stops counting
        new tensors (frees still count, so a ``zero_grad`` before the next forward is seen); planning
        and certification follow at the next training forward, as without an optimizer."""
        meter = self.session.meter if self.session is not None else self.certifier.meter
        if meter is not None:
            meter.pause()

    def measuring(self) -> bool:
        """Whether this step is profiled or measured."""
        return self.session is not None or self.certifier.meter is not None

    # -- forwards outside a training step ------------------------------------------------------------
    def _on_output(self, output: Any) -> None:
        """Watch the training forward's output: a step whose output gets no gradient before the next
        forward (a validation loss computed with grad enabled) is not a training step."""
        if self.measuring() or self.steps.watching is not None:
            self.steps.watch_output(output)

    def _on_other(self) -> None:
        """A forward with grad disabled: after the step's backward it ends the step's measurement (like an
        optimizer step); it is never a step itself."""
        if self.steps.backward_seen and self.measuring():
            self.freeze()

    def _close_previous(self, next_inputs: Sequence[torch.Tensor] = ()) -> None:
        steps = self.steps
        if steps.close_watch():
            return
        if self.session is not None:
            session, self.session = self.session, None
            self.handle.override(None)
            profile = session.end(next_inputs)
            if not steps.was_training():  # no backward: nothing learned, profile the next step
                self._not_a_step()
                return
            steps.trained()
            scale = 1.0
            if steps.varying:
                scale = shape_scale(steps.shapes, bucket_shapes(steps.shapes))
            else:  # the shapes may vary later: this profile then serves its bucket
                self.inforce.seeds[signature_of(bucket_shapes(steps.shapes))] = (profile, list(steps.shapes))
            self._note_training()
            if self.on_profile is not None:
                self.on_profile(profile)
            self.maker.make(profile, margin=0, tries=1, scale=scale)
            return
        if self.certifier.meter is not None:
            reading = self.certifier.stop()
            if not steps.was_training():  # no backward: measure the next step instead
                steps.not_a_step(profiled=False)
                return
            if not reading.valid:  # torch compiled during the step: measured again next step
                return
            self._note_training()
            self.certifier.note_untracked(reading.live)
            self.certifier.certify(reading.measured, reading.counted)

    def _not_a_step(self) -> None:
        """The profiled forward got no backward. Shapes it made look varying do not count; its key is
        remembered (later forwards of that signature run under the plan in force until one of them is a
        training step) and the next step is profiled."""
        self.steps.not_a_step()
        self.inforce.back_to_last()

    def _note_training(self) -> None:
        """A training step ran: its key is the last training step's, its shapes count."""
        self.inforce.last_key = self.inforce.key
        self.steps.note_training()

    def close(self) -> None:
        if self.session is not None:
            self.session.meter.stop()
            self.session = None
        self.certifier.close()
        self.steps.was_training()
        self.handle.remove()


_STATES: "weakref.WeakKeyDictionary[nn.Module, _State]" = weakref.WeakKeyDictionary()


def _optimizer_stepped(opt: torch.optim.Optimizer) -> None:
    for st in list(_STATES.values()):
        if st.measuring() and owns_parameters(opt, st.param_ids):
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
    return applied_plan(model)


def on_plan_error(model: nn.Module, callback: PlanErrorCallback | None) -> bool:
    """Set what becomes of an error of memrt's planning raised during a training step of ``model``.

    :func:`auto` profiles, plans and certifies inside the model's forward pre-hook, so by default such an
    error (a :class:`memrt.BudgetError` found when a step is measured, any exception of profiling, planning
    or certification) propagates out of the model's forward and ends the job. With a ``callback``, the error
    is not raised there: memrt is removed from the model first (:func:`disable`: its hooks are gone and the
    step runs as without memrt, as do the steps after it), then ``callback(exc)`` is called with the error
    (e.g. to warn once); an exception the callback raises propagates from the forward. ``callback=None``
    restores the default. Errors of :func:`auto` itself (a bad budget) are raised by ``auto`` as before.

    Returns True when ``model`` (or the module ``torch.compile`` wrapped) is under :func:`auto` and the
    policy was set, False otherwise (nothing to guard: errors propagate as they are).
    """
    st = _STATES.get(_uncompiled(expect_module("memrt.memory.auto.on_plan_error", model)))
    if st is None:
        return False
    st.on_error = callback
    return True


def on_profiled(model: nn.Module, callback: ProfileCallback | None) -> bool:
    """Call ``callback(profile)`` with each eager profile of a training step of ``model`` (under :func:`auto`
    with a budget: the first step's, and a new input shape's), before the plan is made from it, inside the next
    training forward's pre-hook; ``None`` removes it. Returns False when ``model`` is not under :func:`auto`."""
    st = _STATES.get(_uncompiled(expect_module("memrt.memory.auto.on_profiled", model)))
    if st is None:
        return False
    st.on_profile = callback
    return True


def disable(model: nn.Module) -> nn.Module:
    """Remove every hook memrt installed on ``model`` (auto or apply); the model is as before."""
    outer, model = model, _uncompiled(expect_module("memrt.disable", model))
    st = _STATES.pop(model, None)
    if st is not None:
        st.close()
    from memrt.memory.apply import remove

    remove(model)
    return outer
