"""Apply a plan: route every unit call through the handler of its action.

Instrumentation swaps ``forward`` on the unit instances only (module types, parameters, buffers and
``state_dict`` keys are untouched) and adds one forward pre-hook on the model that numbers the unit
calls of each training step. :func:`memrt.disable` (or ``handle.remove()``) restores everything.

Action handlers live in a small registry (:func:`register_action`): ``keep``, ``recompute`` and the
offload actions (``offload_<tier>``, ``recompute+offload_<tier>``), which use
:class:`memrt.memory.offload.OffloadEngine` through ``pack_hooks(i)`` and ``before_backward(i)``.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn as nn

from memrt.memory.recompute import run_recomputed
from memrt.memory.units import expect_module, find_units

__all__ = ["ActionHandler", "ApplyHandle", "Instrumentation", "apply", "register_action", "registered_actions"]

logger = logging.getLogger(__name__)

UnitCall = Callable[[str, nn.Module, Callable[..., Any], tuple, dict], Any]


class Instrumentation:
    """Routes every call of each unit to ``unit_call(name, module, forward, args, kwargs)``.

    ``on_step(args, kwargs)`` runs at every training forward of the model (grad enabled), before it;
    ``on_other()`` before every other forward of the model (grad disabled, inference mode);
    ``on_output(output)`` after every training forward, with its output.
    """

    def __init__(self, model: nn.Module, units: Sequence[tuple[str, nn.Module]], *, unit_call: UnitCall,
                 on_step: Callable[[tuple, dict], None] | None = None,
                 on_other: Callable[[], None] | None = None,
                 on_output: Callable[[Any], None] | None = None) -> None:
        self._model = weakref.ref(model)  # weak: registries keyed by the model hold this object
        self.units = list(units)
        self.unit_call = unit_call
        self.on_step = on_step
        self.on_other = on_other
        self.on_output = on_output
        self.compiled_actions: dict[str, str] = {}
        """Unit name -> keep | recompute inside a compiled graph (memrt.memory.compiled)."""
        self.compiled_step = False
        """Whether the step that began last is being compiled by dynamo."""
        if on_step is not None and "torch._dynamo" in sys.modules:  # else made when dynamo is first seen
            _pre_outside_graph()
        self._saved: list[tuple[nn.Module, bool, Any]] = []
        self._removed = False
        for name, module in self.units:
            had = "forward" in module.__dict__
            self._saved.append((module, had, module.__dict__.get("forward")))
            original = module.forward
            module.forward = self._make_forward(name, module, original)
        self._hook = (model.register_forward_pre_hook(_StepHook(self), with_kwargs=True)
                      if on_step or on_other else None)
        self._out_hook = model.register_forward_hook(_OutputHook(self)) if on_output else None

    def _make_forward(self, name: str, module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        return _UnitForward(self, name, module, original)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            if self.on_step is not None:
                self.on_step(args, kwargs)
        elif self.on_other is not None:
            self.on_other()

    def _post(self, output: Any) -> None:
        if torch.is_grad_enabled() and self.on_output is not None:
            self.on_output(output)

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        if self._hook is not None:
            self._hook.remove()
        if self._out_hook is not None:
            self._out_hook.remove()
        for module, had, previous in self._saved:
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._saved.clear()


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    return type(module).forward.__get__(module)


def _no_step(module: nn.Module, args: tuple, kwargs: dict) -> None:
    return None


class _UnitForward:
    """The forward installed on a unit instance. A deep copy or pickle of the model gets the plain
    class forward instead (copies and checkpoints carry no memrt state)."""

    __slots__ = ("ref", "name", "module", "original", "__weakref__")

    def __init__(self, inst: Instrumentation, name: str, module: nn.Module, original: Callable[..., Any]) -> None:
        self.ref = weakref.ref(inst)
        self.name, self.module, self.original = name, module, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inst = self.ref()
        if inst is None or inst._removed:
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():  # inside a graph dynamo traces: the plan as checkpointed regions
            from memrt.memory.compiled import compiled_unit_call

            return compiled_unit_call(inst.compiled_actions, self.name, self.original, args, kwargs)
        return inst.unit_call(self.name, self.module, self.original, args, kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.original

    def __reduce__(self):
        return (_class_forward, (self.module,))


class _StepHook:
    """The model's forward pre-hook; copies of the model get a no-op in its place."""

    __slots__ = ("ref", "__weakref__")

    def __init__(self, inst: Instrumentation) -> None:
        self.ref = weakref.ref(inst)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inst = self.ref()
        if inst is not None and not inst._removed:
            # evaluated while dynamo traces (True) or in eager (False); the step's work itself runs eagerly
            if torch.compiler.is_compiling():
                (_OUTSIDE_GRAPH[0] if _OUTSIDE_GRAPH else _pre_outside_graph())(inst, module, args, kwargs, True)
            else:
                if not _OUTSIDE_GRAPH and "torch._dynamo" in sys.modules:  # ready before dynamo traces a step
                    _pre_outside_graph()
                _eager_pre(inst, module, args, kwargs, False)

    def __reduce__(self):
        return (_no_step_hook, ())


def _eager_pre(inst: Instrumentation, module: nn.Module, args: tuple, kwargs: dict, compiled: bool) -> None:
    inst.compiled_step = compiled
    inst._pre(module, args, kwargs)


_OUTSIDE_GRAPH: list[Callable[..., None]] = []


def _pre_outside_graph() -> Callable[..., None]:
    """:func:`_eager_pre` that dynamo never traces; made once ``torch._dynamo`` is imported (never imports it
    for an eager-only job)."""
    if not _OUTSIDE_GRAPH:
        import torch._dynamo

        _OUTSIDE_GRAPH.append(torch._dynamo.disable(_eager_pre))
    return _OUTSIDE_GRAPH[0]


def _no_step_hook() -> Callable[..., None]:
    return _no_step


class _OutputHook:
    """The model's forward hook (training forwards' outputs); copies of the model get a no-op."""

    __slots__ = ("ref", "__weakref__")

    def __init__(self, inst: Instrumentation) -> None:
        self.ref = weakref.ref(inst)

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        inst = self.ref()
        if inst is not None and not inst._removed:
            inst._post(output)

    def __reduce__(self):
        return (_no_output_hook, ())


def _no_output(module: nn.Module, args: tuple, output: Any) -> None:
    return None


def _no_output_hook() -> Callable[..., None]:
    return _no_output


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

    def engine(self, tier: str) -> Any:
        """The offload engine of ``tier`` (created on first use)."""
        if tier not in self.engines:
            try:
                from memrt.memory.offload import OffloadEngine
            except ImportError as exc:
                raise RuntimeError("this plan offloads but memrt.memory.offload is not available") from exc
            from memrt.memory.offload import plan_bytes  # plan-sized: free-space check / pinned pool

            self.engines[tier] = OffloadEngine(tier, device=self.device, directory=self.offload_dir, keep=self._model(),
                                               required_bytes=plan_bytes(getattr(self, "plan", None), tier))
        return self.engines[tier]

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


def _offload(ctx: ApplyContext, action: str) -> ActionHandler:
    recompute = action.startswith("recompute+")
    tier = action.split("offload_", 1)[1]

    def handler(i: int, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        from memrt.memory.offload.wrap import notify_before_backward

        engine = ctx.engine(tier)
        if recompute:
            with engine.packing(i) as store:
                out = run_recomputed(fn, args, kwargs, module=module, name=name, store=store)
            notify_before_backward(out, engine, i)
            return out
        with engine.pack_hooks(i):
            out = fn(*args, **kwargs)
        notify_before_backward(out, engine, i)
        return out

    return handler


register_action("keep", _keep)
register_action("recompute", _recompute)
register_action("offload_", _offload)
register_action("recompute+offload_", _offload)


class ApplyHandle:
    """Plan in force on a model: unit calls are numbered per step and dispatched by action."""

    def __init__(self, model: nn.Module, plan: Any, *, units: Sequence[str] | None = None,
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

    def set_plan(self, plan: Any) -> None:
        self.plan = plan
        self.context.plan = plan  # offload engines size themselves from it
        from memrt.memory.compiled import compiled_action

        actions: dict[str, str] = {}
        for u in getattr(plan, "units", ()) if plan is not None else ():
            act = compiled_action(u.action)  # a unit called several times: recomputed if any call is
            if act == "recompute" or u.name not in actions:
                actions[u.name] = act
        self.inst.compiled_actions = actions

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


def remove(model: nn.Module) -> bool:
    """Remove what :func:`apply` installed; True if something was."""
    h = _HANDLES.pop(model, None)
    if h is None:
        return False
    h.remove()
    return True
