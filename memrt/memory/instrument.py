"""Instrumentation of a model's units: every unit call routed to one function, every training step seen.

:class:`Instrumentation` swaps ``forward`` on the unit instances only (module types, parameters, buffers
and ``state_dict`` keys are untouched) and adds one forward pre-hook on the model that numbers the unit
calls of each training step. The profiler (:mod:`memrt.memory.profile`) and the applied plan
(:mod:`memrt.memory.apply`) both run on it.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

__all__ = ["Instrumentation", "UnitCall", "compiled_unit_call", "is_compiled", "patch_partitioner",
           "restore_partitioner"]

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
        self.compiled_budget = ""
        """The partitioner's ``activation_memory_budget`` the model's compiled graphs are made under, as text
        (dynamo recompiles when it changes); "": torch's own setting, the units' actions are the plan."""
        self.partitioner_saved: tuple[float] | None = None
        """torch's setting while :func:`patch_partitioner` holds it."""
        self.compiled_fallbacks: dict[str, str] = {}
        """Units a compiled step recomputes instead of their planned action (unit name -> that action)."""
        self.compiled_step = False
        """Whether the step that began last runs compiled code: dynamo traces the model's forward, or the
        model holds compiled submodules (``torch.compile(block)``, ``block.compile()``)."""
        self.traced_step = False
        """Whether dynamo traces the model's forward in the step that began last (the units' calls are then
        inside its graph, where memrt's unit calls do not run)."""
        compiled = {name for name, m in model.named_modules() if is_compiled(m)}
        self.compiled_parts = bool(compiled)
        """Whether the model holds compiled submodules: its steps are then measured as compiled steps are."""
        self.units_in_graph = _units_in_graph(compiled, self.units)
        """Whether unit calls run inside a graph below the model: units compiled in place (``module.compile()``)
        or inside a compiled submodule. Read when memrt instruments the model: compile before that."""
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
        # also without on_output: the output hook gives torch's partitioner setting back after a compiled forward
        self._out_hook = model.register_forward_hook(_OutputHook(self)) if on_output or on_step else None

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
        restore_partitioner(self)
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


def _units_in_graph(compiled: set[str], units: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether a unit is compiled in place or has a compiled ancestor below the model (``compiled``: the names
    of the model's compiled modules); its calls then run inside that graph. A unit that is itself a
    ``torch.compile`` wrapper is called outside its graph."""
    for name, module in units:
        if getattr(module, "_compiled_call_impl", None) is not None:
            return True
        parts = name.split(".")
        if any(".".join(parts[:i]) in compiled for i in range(1, len(parts))):
            return True
    return False


def is_compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs code torch.compile made: a ``torch.compile(module)`` wrapper (FSDP2's
    subclass of one included) or a module compiled in place (``module.compile()``)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    if "torch._dynamo" not in sys.modules:  # no wrapper can exist before dynamo is imported
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


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
            if inst.compiled_budget:  # or the partitioner's: the unit as it is
                return self.original(*args, **kwargs)
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
    inst.traced_step = compiled
    inst.compiled_step = compiled or inst.compiled_parts
    if compiled and inst.compiled_fallbacks:  # a compiled step recomputes what the plan offloads: say so once
        for action in sorted(set(inst.compiled_fallbacks.values()) - _FALLBACKS_SAID):
            _FALLBACKS_SAID.add(action)
            logger.warning("memrt: plan action %r cannot run inside a torch.compile graph (saved-tensor hooks that "
                           "move activations do not trace); those units are recomputed instead", action)
    restore_partitioner(inst)  # a forward that raised before its output hook left it set
    inst._pre(module, args, kwargs)
    if compiled:
        patch_partitioner(inst)


_OUTSIDE_GRAPH: list[Callable[..., None]] = []
_FALLBACKS_SAID: set[str] = set()
"""Plan actions already reported as recomputed under torch.compile (said once per process)."""


def _pre_outside_graph() -> Callable[..., None]:
    """:func:`_eager_pre` that dynamo never traces; made once ``torch._dynamo`` is imported (never imports it
    for an eager-only job)."""
    if not _OUTSIDE_GRAPH:
        import torch._dynamo

        _OUTSIDE_GRAPH.append(torch._dynamo.disable(_eager_pre))
        _RESTORE.append(torch._dynamo.disable(restore_partitioner))
    return _OUTSIDE_GRAPH[0]


_RESTORE: list[Callable[[Instrumentation], None]] = []
""":func:`restore_partitioner` that dynamo never traces (it runs after the forward's graphs are compiled); made
with :func:`_pre_outside_graph`, before dynamo traces a step's output hook."""


def patch_partitioner(inst: Instrumentation) -> None:
    """Set torch's ``activation_memory_budget`` to the plan's ratio, from the step hook of a compiled forward to its
    output hook (the forward's graphs are compiled, and partitioned, in between)."""
    import torch._functorch.config as fconfig

    if inst.compiled_budget and inst.partitioner_saved is None:
        inst.partitioner_saved = (fconfig.activation_memory_budget,)
        fconfig.activation_memory_budget = float(inst.compiled_budget)


def restore_partitioner(inst: Instrumentation) -> None:
    """Give torch's ``activation_memory_budget`` back the value it had before :func:`patch_partitioner`."""
    import torch._functorch.config as fconfig

    if inst.partitioner_saved is not None:
        fconfig.activation_memory_budget, = inst.partitioner_saved
        inst.partitioner_saved = None


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
            if torch.compiler.is_compiling():
                if inst.compiled_budget:  # a call outside the graph, after the forward's graphs are compiled
                    _RESTORE[0](inst)
            elif inst.partitioner_saved is not None:  # the forward ran eagerly (dynamo gave up recompiling it)
                restore_partitioner(inst)
            inst._post(output)

    def __reduce__(self):
        return (_no_output_hook, ())


def _no_output(module: nn.Module, args: tuple, output: Any) -> None:
    return None


def _no_output_hook() -> Callable[..., None]:
    return _no_output



def compiled_unit_call(actions: dict[str, str], name: str, fn: Callable[..., Any], args: tuple,
                       kwargs: dict) -> Any:
    """One unit call inside a graph dynamo is tracing: ``actions[name]`` is ``keep`` or ``recompute``."""
    if actions.get(name, "keep") == "recompute" and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)
