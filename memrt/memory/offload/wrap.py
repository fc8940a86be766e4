"""Applying the engine to modules: ``offload_units`` and ``recompute_offload``.

``offload_units(model, units, tier)`` is the lower-level path (the planner's ``apply`` uses the same
pieces through its action registry). Per unit it either offloads everything the unit's forward
saves (``offload_<tier>``), or recomputes the unit in backward and offloads only its inputs
(``recompute+offload_<tier>``), which is how memrt goes below "checkpoint every block".

``recompute_offload`` is memrt's non-reentrant recomputation (:mod:`memrt.memory.recompute`) with the
unit's tensor inputs handed to the engine: the forward builds stock PyTorch's graph, every tensor it
saves is dropped, the inputs go to the tier; the first use in backward loads the inputs and replays the
forward with the saved RNG (dropout bitwise identical) and autocast state. The graph's nodes and the
order in which gradients are summed stay those of stock PyTorch, so gradients are bitwise equal.
Buffers the unit changes in forward (BatchNorm running stats) are restored after the replay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from memrt.memory.offload.engine import OffloadEngine, OffloadStats

__all__ = ["OffloadHandle", "offload_units", "recompute_offload", "install_unit", "notify_before_backward"]

logger = logging.getLogger(__name__)


def recompute_offload(fn: Callable[..., Any], engine: OffloadEngine, unit_index: int, *args: Any,
                      module: nn.Module | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without keeping its activations: recomputed in backward, inputs offloaded.

    ``module`` (the unit) has its buffers restored after the replay. Outputs may be any pytree.
    """
    from memrt.memory.recompute import run_recomputed

    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    with engine.packing(unit_index) as store:
        out = run_recomputed(fn, args, kwargs, module=module if module is not None else nn.Module(),
                             name=f"unit {unit_index}", store=store)
    notify_before_backward(out, engine, unit_index)
    return out


def notify_before_backward(out: Any, engine: OffloadEngine, unit_index: int) -> None:
    """Call ``engine.before_backward(unit_index)`` when the gradient of ``out`` arrives (prefetch trigger)."""
    flat, _ = tree_flatten(out)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            def hook(grad, _i=unit_index):
                engine.before_backward(_i)
                return grad

            t.register_hook(hook)
            return


def install_unit(module: nn.Module, engine: OffloadEngine, unit_index: int, *, recompute: bool) -> Callable[[], None]:
    """Route ``module``'s forward through the engine; returns a function that undoes it."""
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if recompute:
            return recompute_offload(original, engine, unit_index, *args, module=module, **kwargs)
        else:
            with engine.pack_hooks(unit_index):
                out = original(*args, **kwargs)
            notify_before_backward(out, engine, unit_index)
        return out

    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    return undo


@dataclass(kw_only=True)
class OffloadHandle:
    """What :func:`offload_units` installed; ``remove()`` undoes it, ``close()`` also closes the engine."""

    engine: OffloadEngine
    """The engine the units use."""
    unit_names: list[str]
    """Units in forward order."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def stats(self) -> OffloadStats:
        return self.engine.stats()

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def close(self) -> None:
        self.remove()
        self.engine.close()

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def offload_units(model: nn.Module, units: Sequence[nn.Module | str], tier: str = "disk", *,
                  recompute: bool | Sequence[bool] = False, engine: OffloadEngine | None = None,
                  **engine_kwargs: Any) -> OffloadHandle:
    """Offload the activations of ``units`` (submodules or their names in ``model``) to ``tier``.

    ``recompute=True`` (or per unit) recomputes a unit in backward and offloads only its inputs.
    Parameters and buffers of ``model`` are never offloaded. Returns an :class:`OffloadHandle`.
    """
    mods = [model.get_submodule(u) if isinstance(u, str) else u for u in units]
    names = {id(m): n for n, m in model.named_modules()}
    flags = [bool(recompute)] * len(mods) if isinstance(recompute, bool) else [bool(r) for r in recompute]
    if len(flags) != len(mods):
        raise ValueError(f"recompute has {len(flags)} entries for {len(mods)} units")
    if engine is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        engine = OffloadEngine(tier, device=device, keep=model, **engine_kwargs)
    else:
        engine.keep_storages(model)
    handle = OffloadHandle(engine=engine, unit_names=[names.get(id(m), type(m).__name__) for m in mods])
    for i, (m, rc) in enumerate(zip(mods, flags)):
        handle._undo.append(install_unit(m, engine, i, recompute=rc))
    return handle
