"""Non-reentrant recomputation of one unit's forward, with saved-tensor hooks.

During the forward, every tensor autograd wants to save is replaced by a small handle and dropped;
only the unit's inputs stay referenced. When backward first unpacks a handle, the unit's forward runs
again with the RNG state (CPU and the unit's CUDA device), autocast state and grad mode of the original
call, collecting the tensors to save in the same order. Buffers that the original forward mutated in
place (BatchNorm running statistics) are restored after the recomputation, so they change exactly once.
A recomputed tensor is released as soon as autograd releases its handle.

With an :class:`InputStore` (the offload engine's), the unit's tensor inputs are handed to the store
too (to disk or host memory) and loaded back for the recomputation. The autograd graph is the one
stock PyTorch builds in every case: only what is saved changes, never the nodes or the order in which
gradients are summed, so gradients are bitwise those of a run without memrt.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["InputStore", "RecomputeError", "RecomputeHooks", "run_recomputed"]


class RecomputeError(RuntimeError):
    """The recomputed forward saved different tensors than the original (data-dependent control flow)."""


class RecomputeHooks:
    """Optional callbacks for profiling: ``on_pack(tensor)`` in forward; ``on_begin()``/``on_end()`` around a recompute."""

    def on_pack(self, t: torch.Tensor) -> None: ...
    def on_begin(self) -> None: ...
    def on_end(self) -> None: ...


class InputStore(Protocol):
    """Where a recomputed unit's inputs wait for backward: ``pack`` returns the tensor itself (kept) or
    a handle; ``unpack`` returns the tensor for a handle (and anything else unchanged)."""

    def pack(self, t: torch.Tensor) -> Any: ...
    def unpack(self, obj: Any) -> torch.Tensor: ...


class _Stored:
    __slots__ = ("obj", "requires_grad")

    def __init__(self, obj: Any, requires_grad: bool) -> None:
        self.obj, self.requires_grad = obj, requires_grad


class _Handle:
    __slots__ = ("frame", "idx", "__weakref__")

    def __init__(self, frame: "_Frame", idx: int) -> None:
        self.frame = frame
        self.idx = idx
        frame.alive.add(idx)

    def __del__(self) -> None:
        f = self.frame
        f.alive.discard(self.idx)
        f.stash.pop(self.idx, None)


def _autocast_state(device_types: tuple[str, ...]) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types]


class _Frame:
    __slots__ = ("fn", "flat", "spec", "store", "module", "name", "cpu_rng", "cuda_rng", "cuda_device", "autocast",
                 "cache_enabled", "mutated", "stash", "alive", "n_packed", "hooks")

    def __init__(self, fn, args, kwargs, module, name, hooks, store):
        self.fn, self.module, self.name, self.hooks, self.store = fn, module, name, hooks, store
        flat, self.spec = tree_flatten((args, kwargs))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_device = None
        self.cuda_rng = None
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                self.cuda_device = t.device
                self.cuda_rng = torch.cuda.get_rng_state(t.device)
                break
        if store is not None:
            flat = [_Stored(store.pack(v), v.requires_grad) if isinstance(v, torch.Tensor) else v for v in flat]
        self.flat = flat
        types = ("cpu", "cuda") if self.cuda_device is not None else ("cpu",)
        self.autocast = _autocast_state(types)
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.mutated: list[torch.Tensor] = []
        self.stash: dict[int, torch.Tensor] = {}
        self.alive: set[int] = set()
        self.n_packed = 0

    def inputs(self) -> tuple[tuple, dict]:
        """The call's (args, kwargs): the originals, or copies loaded from the store (same requires_grad)."""
        if self.store is None:
            return tree_unflatten(self.flat, self.spec)
        flat = []
        for v in self.flat:
            if isinstance(v, _Stored):
                t = self.store.unpack(v.obj)
                if t is not v.obj:  # a loaded copy: a fresh leaf, as the saved tensors of a graph are
                    t = t.detach().requires_grad_(v.requires_grad)
                v = t
            flat.append(v)
        return tree_unflatten(flat, self.spec)

    def recompute(self) -> None:
        stash: list[torch.Tensor | None] = []
        alive = self.alive

        def pack(x: torch.Tensor) -> None:
            stash.append(x.detach() if len(stash) in alive else None)

        def unpack(_: Any) -> torch.Tensor:
            raise RuntimeError("memrt: tensors saved during a recomputation are never unpacked")

        if self.hooks is not None:
            self.hooks.on_begin()
        args, kwargs = self.inputs()
        saved_bufs = [(b, b.detach().clone()) for b in self.mutated]
        cur_cpu = torch.get_rng_state()
        cur_cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None
        try:
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_device is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.cuda_device)
            with contextlib.ExitStack() as stack:
                for dev, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type=dev, enabled=enabled, dtype=dtype,
                                                       cache_enabled=self.cache_enabled))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
                self.fn(*args, **kwargs)
        finally:
            torch.set_rng_state(cur_cpu)
            if cur_cuda is not None:
                torch.cuda.set_rng_state(cur_cuda, self.cuda_device)
            with torch.no_grad():
                for b, v in saved_bufs:
                    b.copy_(v)
            del saved_bufs, args, kwargs
        if len(stash) != self.n_packed:
            raise RecomputeError(
                f"memrt: recomputing unit {self.name!r} saved {len(stash)} tensors, the original forward saved "
                f"{self.n_packed}; its forward is not deterministic in structure. Exclude it from recompute "
                f"(memrt.auto(..., units=[...]) with other unit classes) or use budget=None.")
        self.stash = {i: t for i, t in enumerate(stash) if t is not None}
        if self.hooks is not None:
            self.hooks.on_end()


def run_recomputed(fn: Callable[..., Any], args: tuple, kwargs: dict, *, module: torch.nn.Module,
                   name: str = "", hooks: RecomputeHooks | None = None, store: InputStore | None = None) -> Any:
    """Call ``fn(*args, **kwargs)`` keeping only its inputs (in ``store`` when given); backward recomputes
    what it needs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs, module, name, hooks, store)
    on_pack = hooks.on_pack if hooks is not None else None

    def pack(x: torch.Tensor) -> _Handle:
        if on_pack is not None:
            on_pack(x)
        h = _Handle(frame, frame.n_packed)
        frame.n_packed += 1
        return h

    def unpack(h: _Handle) -> torch.Tensor:
        f = h.frame
        if h.idx not in f.stash:
            f.recompute()
        t = f.stash.pop(h.idx, None)
        if t is None:
            raise RecomputeError(f"memrt: saved tensor {h.idx} of unit {f.name!r} is missing after recomputation")
        return t

    buffers = list(module.buffers())
    versions = [b._version for b in buffers]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args, **kwargs)
    frame.mutated = _mutated_buffers(module, buffers, versions)
    return out


def _mutated_buffers(module: torch.nn.Module, buffers: list[torch.Tensor], versions: list[int]) -> list[torch.Tensor]:
    """Buffers the forward changed: version bumped (Python in-place ops), or running statistics of
    norm layers in training mode (their kernels update them without bumping the version)."""
    out = {id(b): b for b, v in zip(buffers, versions) if b._version != v}
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            for b in m.buffers(recurse=False):
                out.setdefault(id(b), b)
    return list(out.values())
