"""Non-reentrant recomputation of one unit's forward, with saved-tensor hooks.

During the forward, every tensor autograd wants to save is replaced by a small handle and dropped;
only the unit's inputs stay referenced. When backward first unpacks a handle, the unit's forward runs
again with the RNG state (CPU and the unit's CUDA device), autocast state and grad mode of the original
call, collecting the tensors to save in the same order. Buffers that the original forward mutated in
place (BatchNorm running statistics) are restored after the recomputation, so they change exactly once.
A recomputed tensor is released as soon as autograd releases its handle.

Arguments that are objects rather than tensors or plain values (a key/value cache, a config) may be
changed by the forward (a cache appends this layer's keys): the replay gets a copy of each as it was
at the original call (tensors inside shared, not copied), and its changes to that copy are dropped.
Every saved tensor's shape and dtype are checked against the original's, so a replay that computes
something else fails with :class:`RecomputeError` instead of handing backward wrong tensors.

With an :class:`InputStore` (the offload engine's), the unit's tensor inputs are handed to the store
too (to disk or host memory) and loaded back for the recomputation. The autograd graph is the one
stock PyTorch builds in every case: only what is saved changes, never the nodes or the order in which
gradients are summed, so gradients are bitwise those of a run without memrt.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
from typing import Any, Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["InputStore", "RecomputeError", "RecomputeHooks", "run_recomputed"]

logger = logging.getLogger(__name__)

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, type)


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


class _Snapshot:
    """An object argument as it was at the original call (tensors inside are shared)."""

    __slots__ = ("obj", "memo")

    def __init__(self, obj: Any, memo: dict[int, Any]) -> None:
        self.obj, self.memo = obj, memo

    def copy(self) -> Any:
        return _share_copy(self.obj, self.memo)


class _ShareTensors(TorchFunctionMode):
    """Inside: ``copy.deepcopy`` returns every tensor itself (the object around it is copied)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__:
            return args[0]
        return func(*args, **(kwargs or {}))


def _share_copy(obj: Any, memo: dict[int, Any]) -> Any:
    with _ShareTensors():
        return copy.deepcopy(obj, dict(memo))


def _snapshot(obj: Any, module: torch.nn.Module, name: str) -> Any:
    """``obj`` itself when it is a plain value or a callable, else a :class:`_Snapshot` of it."""
    if isinstance(obj, _PLAIN) or callable(obj) or isinstance(obj, torch.nn.Module):
        return obj
    memo: dict[int, Any] = {id(m): m for m in module.modules()}
    memo.update((id(p), p) for p in module.parameters())
    try:
        return _Snapshot(_share_copy(obj, memo), memo)
    except Exception as exc:  # noqa: BLE001 - an object deepcopy cannot copy is used as it is
        logger.debug("unit %s: argument of type %s cannot be copied (%s); the replay uses it as it is then",
                     name, type(obj).__name__, exc)
        return obj


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
                 "cache_enabled", "mutated", "stash", "alive", "shapes", "hooks")

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
        out = []
        for v in flat:
            if isinstance(v, torch.Tensor):
                if store is not None:
                    v = _Stored(store.pack(v), v.requires_grad)
            else:
                v = _snapshot(v, module, name)
            out.append(v)
        self.flat = out
        types = ("cpu", "cuda") if self.cuda_device is not None else ("cpu",)
        self.autocast = _autocast_state(types)
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.mutated: list[torch.Tensor] = []
        self.stash: dict[int, torch.Tensor] = {}
        self.alive: set[int] = set()
        self.shapes: list[tuple[torch.Size, torch.dtype]] = []

    def inputs(self) -> tuple[tuple, dict]:
        """The call's (args, kwargs) for a replay: tensors as given (or loaded back from the store, with
        the same requires_grad), object arguments as they were at the call."""
        flat = []
        for v in self.flat:
            if isinstance(v, _Stored):
                t = self.store.unpack(v.obj)
                if t is not v.obj:  # a loaded copy: a fresh leaf, as the saved tensors of a graph are
                    t = t.detach().requires_grad_(v.requires_grad)
                v = t
            elif isinstance(v, _Snapshot):
                v = v.copy()
            flat.append(v)
        return tree_unflatten(flat, self.spec)

    def recompute(self) -> None:
        stash: list[torch.Tensor | None] = []
        alive, shapes = self.alive, self.shapes

        def pack(x: torch.Tensor) -> None:
            i = len(stash)
            if i < len(shapes) and (x.shape, x.dtype) != shapes[i]:
                raise RecomputeError(
                    f"memrt: recomputing unit {self.name!r} saved a {tuple(x.shape)} {x.dtype} tensor where the "
                    f"original forward saved a {tuple(shapes[i][0])} {shapes[i][1]} one: the replay computed "
                    f"something else (the forward reads state that changed since, e.g. an argument it mutates). "
                    f"Exclude this unit (memrt.auto(..., units=[...])) or use budget=None.")
            stash.append(x.detach() if i in alive else None)

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
        if len(stash) != len(shapes):
            raise RecomputeError(
                f"memrt: recomputing unit {self.name!r} saved {len(stash)} tensors, the original forward saved "
                f"{len(shapes)}; its forward is not deterministic in structure. Exclude it from recompute "
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
        h = _Handle(frame, len(frame.shapes))
        frame.shapes.append((x.shape, x.dtype))
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
