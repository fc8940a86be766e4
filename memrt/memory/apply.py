"""Apply a plan: route every unit call through the handler of its action.

The units are instrumented (:class:`memrt.memory.instrument.Instrumentation`: ``forward`` swapped on the
unit instances only, one pre-hook on the model numbering each step's unit calls); :func:`memrt.disable`
(or ``handle.remove()``) restores everything.

Action handlers live in a small registry (:func:`register_action`): ``keep`` and ``recompute`` here; the
offload tiers register ``offload_<tier>`` and ``recompute+offload_<tier>`` (:mod:`memrt.memory.offload.plugin`),
keeping their engines in :attr:`ApplyContext.engines`, closed with the plan.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
import torch.nn as nn

from memrt.memory.instrument import Instrumentation, UnitCall
from memrt.memory.recompute import run_recomputed
from memrt.memory.units import expect_module, find_units

if TYPE_CHECKING:
    from memrt.memory.planner import Plan

__all__ = ["ActionHandler", "ApplyHandle", "Instrumentation", "applied_plan", "apply", "register_action",
           "registered_actions", "remove"]

logger = logging.getLogger(__name__)


# -- action registry ----------------------------------------------------------------------------------


class ActionHandler(Protocol):
    def __call__(self, index: int, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple,
                 kwargs: dict) -> Any: ...


class ApplyContext:
    """What handlers may need: the model, its device, offload settings, shared engines."""

    def __init__(self, model: nn.Module, device: torch.device, offload_dir: str | None = None) -> None:
        self._model = weakref.ref(model)
        self.device, self.offload_dir = device, offload_dir
        self.engines: dict[str, Any] = {}
        self.plan: Plan | None = None
        """The plan in force (offload engines size themselves from it)."""

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    def close(self) -> None:
        for e in self.engines.values():
            try:
                e.close()
            except Exception as exc:  # noqa: BLE001 - closing must not mask the caller's error
                logger.warning("closing offload engine: %s", exc)
        self.engines.clear()


HandlerFactory = Callable[[ApplyContext, str], ActionHandler]
_REGISTRY: dict[str, HandlerFactory] = {}


def register_action(prefix: str, factory: HandlerFactory) -> None:
    """Handle actions equal to ``prefix`` (or starting with ``prefix``) with ``factory(context, action)``."""
    _REGISTRY[prefix] = factory


def registered_actions() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(action: str) -> HandlerFactory:
    if action in _REGISTRY:
        return _REGISTRY[action]
    for prefix in sorted(_REGISTRY, key=len, reverse=True):
        if action.startswith(prefix):
            return _REGISTRY[prefix]
    raise ValueError(f"plan action {action!r} has no handler; registered: {', '.join(registered_actions())}")


def _keep(ctx: ApplyContext, action: str) -> ActionHandler:
    return lambda i, name, module, fn, args, kwargs: fn(*args, **kwargs)


def _recompute(ctx: ApplyContext, action: str) -> ActionHandler:
    return lambda i, name, module, fn, args, kwargs: run_recomputed(fn, args, kwargs, module=module, name=name)


register_action("keep", _keep)
register_action("recompute", _recompute)


class ApplyHandle:
    """Plan in force on a model: unit calls are numbered per step and dispatched by action."""

    def __init__(self, model: nn.Module, plan: Plan | None, *, units: Sequence[str] | None = None,
                 offload_dir: str | None = None, on_step: Callable[[tuple, dict], None] | None = None,
                 unit_call: UnitCall | None = None, on_other: Callable[[], None] | None = None,
                 on_output: Callable[[Any], None] | None = None) -> None:
        from memrt.memory.profile import model_device

        self.plan = plan
        self.context = ApplyContext(model, model_device(model), offload_dir)
        self.context.plan = plan  # offload engines size themselves from it
        self._handlers: dict[str, ActionHandler] = {}
        self._calls: dict[str, int] = {}
        self._index = 0
        self._extra_step = on_step
        self._override = unit_call
        self.inst = Instrumentation(model, find_units(model, units), unit_call=self._unit_call, on_step=self._on_step,
                                    on_other=on_other, on_output=on_output)
        self.set_plan(plan)

    def override(self, unit_call: UnitCall | None) -> None:
        """Route every unit call of a step with grad enabled through ``unit_call`` (a profile's), whatever the
        plan says; None: back to the plan's actions."""
        self._override = unit_call

    def set_plan(self, plan: Plan | None) -> None:
        self.plan = plan
        self.context.plan = plan  # offload engines size themselves from it
        from memrt.memory.compiled import compiled_action

        actions: dict[str, str] = {}
        fallbacks: dict[str, str] = {}
        for u in plan.units if plan is not None else ():
            act = compiled_action(u.action)  # a unit called several times: recomputed if any call is
            if act == "recompute" or u.name not in actions:
                actions[u.name] = act
            if act != u.action:
                fallbacks[u.name] = u.action
        self.inst.compiled_actions = actions
        budget = plan.compiled_budget if plan is not None else None
        self.inst.compiled_budget = "" if budget is None else str(budget)
        self.inst.compiled_fallbacks = fallbacks  # said when a compiled graph traces the unit

    def _on_step(self, args: tuple, kwargs: dict) -> None:
        self._calls.clear()
        self._index = 0
        if self._extra_step is not None:
            self._extra_step(args, kwargs)

    def handler(self, action: str) -> ActionHandler:
        h = self._handlers.get(action)
        if h is None:
            h = self._handlers[action] = _lookup(action)(self.context, action)
        return h

    def _unit_call(self, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if self._override is not None:
            return self._override(name, module, fn, args, kwargs)
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        index = self._index
        self._index += 1
        action = self.plan.action_for(name, call) if self.plan is not None else "keep"
        return self.handler(action)(index, name, module, fn, args, kwargs)

    def remove(self) -> None:
        self.inst.remove()
        self.context.close()


_HANDLES: "weakref.WeakKeyDictionary[nn.Module, ApplyHandle]" = weakref.WeakKeyDictionary()


def apply(model: nn.Module, plan: Any, *, units: Sequence[str] | None = None, offload_dir: str | None = None) -> nn.Module:
    """Put ``plan`` in force on ``model`` (same object returned); :func:`memrt.disable` removes it."""
    from memrt.memory.planner import Plan

    expect_module("memrt.apply", model)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"memrt.apply expects a memrt.Plan (from memrt.plan or memrt.plan_of) or None, "
                        f"got {type(plan).__name__}")
    old = _HANDLES.pop(model, None)
    if old is not None:
        old.remove()
    _HANDLES[model] = ApplyHandle(model, plan, units=units, offload_dir=offload_dir)
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan :func:`apply` put in force on ``model`` (None where it put none, or :func:`apply` was not used)."""
    h = _HANDLES.get(model)
    return h.plan if h is not None else None


def remove(model: nn.Module) -> bool:
    """Remove what :func:`apply` installed; True if something was."""
    h = _HANDLES.pop(model, None)
    if h is None:
        return False
    h.remove()
    return True
