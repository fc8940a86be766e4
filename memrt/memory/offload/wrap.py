"""Applying the engine to modules: ``offload_units`` and ``recompute_offload``.

``offload_units(model, units, tier)`` is the lower-level path (the planner's ``apply`` uses the same
pieces through its action registry). Per unit it either offloads everything the unit's forward
saves (``offload_<tier>``), or recomputes the unit in backward and offloads only its inputs
(``recompute+offload_<tier>``), which is how memrt goes below "checkpoint every block".

``recompute_offload`` is a reentrant-style checkpoint: the forward runs without a graph, the unit's
tensor inputs are saved through the engine's hooks (so they go to the tier), and backward loads them,
replays the forward with the saved RNG state (dropout is bitwise identical) and autocast state, and
backpropagates through it. Buffers the unit changes in forward (BatchNorm running stats) are restored
after the replay so a recomputed step updates them exactly once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from memrt.memory.offload.engine import OffloadEngine, OffloadStats

__all__ = ["OffloadHandle", "offload_units", "recompute_offload", "install_unit", "notify_before_backward"]

logger = logging.getLogger(__name__)


class _Box:
    """Non-tensor state of one recompute_offload call."""

    __slots__ = ("fn", "spec", "slots", "consts", "out_spec", "out_slots", "out_consts", "rng_cpu",
                 "rng_cuda", "cuda_device", "autocast", "module")


class _RecomputeOffload(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box: _Box, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.box = box
        box.rng_cpu = torch.get_rng_state()
        if box.cuda_device is not None:
            box.rng_cuda = torch.cuda.get_rng_state(box.cuda_device)
        args, kwargs = _rebuild(box, tensors)
        with torch.no_grad():
            out = box.fn(*args, **kwargs)
        flat, box.out_spec = tree_flatten(out)
        box.out_slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        box.out_consts = [None if isinstance(v, torch.Tensor) else v for v in flat]
        ctx.save_for_backward(*tensors)
        outs = tuple(flat[i] for i in box.out_slots)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        box = ctx.box
        saved = ctx.saved_tensors  # loads the inputs back from the tier
        inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[2:])]
        snapshot = [(b, b.clone()) for b in box.module.buffers()] if box.module is not None else []
        devices = [box.cuda_device] if box.cuda_device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(box.rng_cpu)
            if box.cuda_device is not None:
                torch.cuda.set_rng_state(box.rng_cuda, box.cuda_device)
            args, kwargs = _rebuild(box, inputs)
            with torch.enable_grad(), _autocast(box.autocast):
                out = box.fn(*args, **kwargs)
        with torch.no_grad():
            for b, value in snapshot:
                b.data.copy_(value)  # .data: no version bump (autograd saved these buffers)
        flat, _ = tree_flatten(out)
        outs = [flat[i] for i in box.out_slots]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[t.grad if need else None for t, need in zip(inputs, ctx.needs_input_grad[2:])])


def _rebuild(box: _Box, tensors) -> tuple[tuple, dict]:
    flat = list(box.consts)
    for slot, t in zip(box.slots, tensors):
        flat[slot] = t
    return tree_unflatten(flat, box.spec)


def _autocast(state):
    import contextlib

    if state is None:
        return contextlib.nullcontext()
    device_type, dtype = state
    return torch.autocast(device_type, dtype=dtype)


def recompute_offload(fn: Callable[..., Any], engine: OffloadEngine, unit_index: int, *args: Any,
                      module: nn.Module | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without keeping its activations: recomputed in backward, inputs offloaded.

    ``module`` (the unit) has its buffers restored after the replay. Outputs may be any pytree.
    """
    flat, spec = tree_flatten((args, kwargs))
    box = _Box()
    box.fn = fn
    box.spec = spec
    box.slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    box.consts = [None if isinstance(v, torch.Tensor) else v for v in flat]
    box.module = module
    tensors = [flat[i] for i in box.slots]
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    box.cuda_device = device
    box.rng_cuda = None
    box.autocast = None
    for dt in ("cuda", "cpu"):
        if torch.is_autocast_enabled(dt):
            box.autocast = (dt, torch.get_autocast_dtype(dt))
    with engine.pack_hooks(unit_index):
        # anchor: a grad-requiring input so the outputs get a graph even when no input needs grad
        # (the unit's parameters do), as with the first block fed by data
        anchor = torch.empty(0, requires_grad=True)
        outs = _RecomputeOffload.apply(box, anchor, *tensors)
    flat_out = list(box.out_consts)
    for slot, t in zip(box.out_slots, outs):
        flat_out[slot] = t
    return tree_unflatten(flat_out, box.out_spec)


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
            out = recompute_offload(original, engine, unit_index, *args, module=module, **kwargs)
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
