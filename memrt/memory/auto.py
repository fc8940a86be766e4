"""``memrt.auto(model, budget)``: profile step 1, plan, apply, certify on the next step.

A step is the span from one training forward of the model (grad enabled) to the end of the step of an
optimizer that owns its parameters (or, without one, to the next training forward): what runs between
the optimizer step and the next forward (evaluation, logging, another model) is not the step's. For each input
signature (shapes, dtypes): the first step is profiled (every unit recomputed, so it needs no more
memory than checkpointing every unit), the plan is made at the start of the next step and is in force
from then on; that step's peak is measured (CUDA: allocator statistics; CPU: the tracker) and, over
budget, the plan is remade with the overshoot held back (at most ``MAX_TRIES`` plans), else
:class:`memrt.BudgetError` reports what was measured. Plans are cached per (structure, input
signature, dtype, device, budget).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn

from memrt.config import Budget, MemrtConfig, load_config, parse_budget
from memrt.errors import BudgetError
from memrt.memory.apply import ApplyHandle
from memrt.memory.cache import CacheEntry, PlanCache, cache_key, default_cache
from memrt.memory.meter import (Meter, device_capacity_bytes, known_tensors, make_meter, on_optimizer_step,
                                owns_parameters, watch_optimizers)
from memrt.memory.planner import Plan, plan as make_plan
from memrt.memory.profile import Profile, ProfileSession, input_signature, model_device
from memrt.memory.units import find_units, structure_key

__all__ = ["auto", "plan_of", "disable", "MAX_TRIES"]

logger = logging.getLogger(__name__)

MAX_TRIES = 3
"""Plans made per key before an overshoot of the budget is an error."""


class _State:
    def __init__(self, model: nn.Module, budget_bytes: int | None, *, units: Sequence[str] | None,
                 offload: str, cache: PlanCache, offload_dir: str | None) -> None:
        self._model = weakref.ref(model)
        self.budget = budget_bytes
        self.offload = offload
        self.cache = cache
        self.device = model_device(model)
        self.units = find_units(model, units)
        self.structure = structure_key(model, self.units)
        self.dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", "")
        self.key: str | None = None
        self.entry: CacheEntry | None = None
        self.session: ProfileSession | None = None
        self.meter: Meter | None = None
        self.step = 0
        self.param_ids = {id(p) for p in model.parameters()}
        self.handle = ApplyHandle(model, None, units=units, offload_dir=offload_dir, on_step=self._on_step)

    # -- step boundary ------------------------------------------------------------------------------
    def _on_step(self, args: tuple, kwargs: dict) -> None:
        self.step += 1
        self._close_previous(_flat_tensors((args, kwargs)))
        sig = input_signature(args, kwargs)
        key = cache_key(self.structure, sig, self.dtype, str(self.device), self.budget, self.offload)
        if key == self.key and self.entry is not None:
            if self.entry.plan.measured_peak_bytes is None and self.meter is None:
                self._start_measure((args, kwargs))
            return
        self.key = key
        self.entry = self.cache.get(key)
        if self.entry is not None:
            self.handle.set_plan(self.entry.plan)
            if self.budget is not None:
                self._start_measure((args, kwargs))
            return
        if self.budget is None:  # no limit: plan for speed, nothing to profile
            entry = CacheEntry(plan=Plan(budget_bytes=None, structure=self.structure, signature=sig,
                                         device=str(self.device)),
                               profile=Profile(device=str(self.device), structure=self.structure, signature=sig))
            self.cache.put(key, entry)
            self.entry = entry
            self.handle.set_plan(entry.plan)
            return
        if self.handle.inst.compiled_step:  # a compiled step: profiled eagerly beside it, then planned
            from memrt.memory.compiled import shadow_profile

            profile = shadow_profile(self._model(), self.units, self.device, args, kwargs,
                                     lambda call: setattr(self.handle, "_override", call))
            profile.signature = sig
            self._make_plan(profile, margin=0, tries=1)
            return
        # profile this step: every unit recomputed
        self.session = ProfileSession(self._model(), self.units, device=self.device)
        self.session.profile.signature = sig
        self.handle._override = self.session.unit_call
        self.session.begin((args, kwargs))

    def freeze(self) -> None:
        """An optimizer owning the model's parameters has stepped: the step's measurement stops counting
        new tensors (frees still count, so a ``zero_grad`` before the next forward is seen); planning
        and certification follow at the next training forward, as without an optimizer."""
        meter = self.session.meter if self.session is not None else self.meter
        if meter is not None:
            meter.pause()

    def _close_previous(self, next_inputs: Sequence[torch.Tensor] = ()) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.handle._override = None
            profile = session.end(next_inputs)
            self._make_plan(profile, margin=0, tries=1)
            return
        if self.meter is not None:
            meter, self.meter = self.meter, None
            measured = meter.peak
            meter.mark("step_end", "certify")
            meter.stop()
            if getattr(meter, "valid", True):  # a compiled step that compiled is measured again next step
                self._certify(measured)

    def _make_plan(self, profile: Profile, *, margin: int, tries: int) -> None:
        try:
            p = make_plan(profile, self.budget, margin_bytes=margin, offload=self.offload)
        except BudgetError:
            self.entry = None
            self.key = None
            self.handle.set_plan(None)
            raise
        p.tries = tries
        self.entry = CacheEntry(plan=p, profile=profile)
        self.cache.put(self.key, self.entry)
        self.handle.set_plan(p)
        _record(p)
        logger.info("memrt plan (try %d):\n%s", tries, p)

    def _certify(self, measured: int) -> None:
        entry = self.entry
        if entry is None:
            return
        p = entry.plan
        p.measured_peak_bytes = int(measured)
        _record(p)
        if self.budget is None or measured <= self.budget:
            self.cache.put(self.key, entry)
            return
        over = measured - self.budget
        if p.tries >= MAX_TRIES:
            key, self.key, self.entry = self.key, None, None
            self.handle.set_plan(None)
            raise BudgetError(self.budget, measured + p.margin_bytes,
                              f"measured peak {measured} bytes exceeds the budget by {over} bytes after "
                              f"{p.tries} plans (predicted {p.predicted_peak_bytes}); the error term of the "
                              f"memory model did not close")
        logger.warning("memrt: measured peak %d bytes is %d over the budget; re-planning with that held back",
                       measured, over)
        self._make_plan(entry.profile, margin=p.margin_bytes + over + max(over // 8, 4096), tries=p.tries + 1)

    def _start_measure(self, inputs: Any) -> None:
        if self.budget is None:
            return
        if self.handle.inst.compiled_step:  # no dispatch mode under dynamo: it would run the step eagerly
            from memrt.memory.compiled import compiled_meter

            self.meter = compiled_meter(self.device)
        else:
            self.meter = make_meter(self.device)
        self.meter.start(known_tensors(self._model(), _flat_tensors(inputs)))
        self.meter.mark("step_begin", "certify")

    def close(self) -> None:
        if self.session is not None:
            self.session.meter.stop()
            self.session = None
        if self.meter is not None:
            self.meter.stop()
            self.meter = None
        self.handle.remove()


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


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
    if not isinstance(model, nn.Module):
        raise TypeError(f"memrt.auto expects a torch.nn.Module, got {type(model).__name__}")
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
    _STATES[model] = _State(model, budget_bytes, units=units, offload=off, cache=cache, offload_dir=cfg.offload_dir)
    return compiled


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its forward is what the compiled graph traces), else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def plan_of(model: nn.Module) -> Plan | None:
    """The plan in force on ``model`` (None before the first plan or without memrt)."""
    model = _uncompiled(model)
    st = _STATES.get(model)
    if st is not None:
        return st.entry.plan if st.entry is not None else None
    from memrt.memory.apply import _HANDLES

    h = _HANDLES.get(model)
    return h.plan if h is not None else None


def disable(model: nn.Module) -> nn.Module:
    """Remove every hook memrt installed on ``model`` (auto or apply); the model is as before."""
    outer, model = model, _uncompiled(model)
    st = _STATES.pop(model, None)
    if st is not None:
        st.close()
    from memrt.memory.apply import remove

    remove(model)
    return outer
