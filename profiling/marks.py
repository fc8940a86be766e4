"""Mark training steps and unit boundaries (forward and backward) in the recorder.

:class:`UnitMarker` hooks a model's units so each forward and backward of a unit records a memory
event at its start and end (``unit_begin``/``unit_end`` labelled ``name@phase``) and a trace range
``memrt::name.phase``; ``marker.step()`` brackets a training step (its start fixes the step's fixed
bytes, see :mod:`memrt.profiling.timeline`). memrt's own memory engine records the same events; this
class serves code that profiles without planning (benchmarks, tests, users' own loops).

Live bytes come from the ``live_bytes`` callable given, else ``torch.cuda.memory_allocated`` on CUDA
(on CPU pass one, e.g. ``lambda: tracker.live_bytes`` of a started ``CpuMemoryTracker``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

from memrt.profiling.recorder import Recorder, get_recorder
from memrt.profiling.trace import profiler_on

__all__ = ["UnitMarker", "default_live_bytes", "default_units"]


def _first_grad_tensor(obj: Any) -> Any:
    """The first tensor requiring grad in ``obj`` (a tensor, or nested tuples/lists/dicts of them)."""
    if getattr(obj, "requires_grad", False) and hasattr(obj, "register_hook"):
        return obj
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        t = _first_grad_tensor(item)
        if t is not None:
            return t
    return None


def default_live_bytes(device: Any = "cpu", *, tracker: Any = None) -> Callable[[], int]:
    """A zero-argument function returning live tensor bytes on ``device``.

    CUDA: ``torch.cuda.memory_allocated`` (a host-side counter, no synchronize). CPU: PyTorch keeps no
    allocator statistics, so pass a started ``memrt.profiling.cpu_tracker.CpuMemoryTracker`` as
    ``tracker`` (it watches every operator, which has its own cost) or your own callable to UnitMarker.
    """
    if tracker is not None:
        return lambda: tracker.live_bytes
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    raise ValueError(f"no live-bytes source for device {device}: pass live_bytes=<callable returning bytes> "
                     "to UnitMarker, or tracker=CpuMemoryTracker().start() (memrt.profiling.cpu_tracker); "
                     "CPU has no allocator statistics")


def default_units(model: Any) -> list[tuple[str, Any]]:
    """The children of the model's ModuleList/Sequential containers, else its direct children."""
    import torch.nn as nn

    units = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 1:
            kinds = {type(c) for c in mod}
            if len(kinds) == 1:
                units += [(f"{name}.{i}" if name else str(i), c) for i, c in enumerate(mod)]
    return units or list(model.named_children())


class UnitMarker:
    """Hooks on ``units`` (name -> module, pairs, or a model whose :func:`default_units` are used)."""

    def __init__(self, units: Any, *, live_bytes: Callable[[], int] | None = None, device: Any = None,
                 backward: bool = True, recorder: Recorder | None = None) -> None:
        import torch.nn as nn

        if isinstance(units, nn.Module):
            if device is None:
                p = next(units.parameters(), None)
                device = p.device if p is not None else "cpu"
            units = default_units(units)
        elif isinstance(units, Mapping):
            units = list(units.items())
        else:
            units = list(units)
        if not units:
            raise ValueError("UnitMarker needs at least one unit (name, module)")
        self.units: list[tuple[str, nn.Module]] = units
        self.live_bytes = live_bytes or default_live_bytes(device or next(units[0][1].parameters()).device)
        self.recorder = recorder or get_recorder()
        self._open: dict[tuple[str, str], list[tuple[float, Any]]] = {}
        self._bw_pending: dict[str, list[bool]] = {}
        self._handles = []
        self.backward = backward
        for name, mod in units:
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(mod.register_forward_hook(self._post_hook(name)))

    # Backward marks use tensor hooks, not module full-backward hooks: no extra autograd nodes, no
    # wrapping of the unit's inputs and outputs. The unit's backward begins when the gradient of its
    # output is ready and ends when the gradient of its input is complete.
    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, args: Any) -> None:
            self.begin(name, "forward")
            t = _first_grad_tensor(args) if self.backward and self._active() else None
            if t is not None:
                t.register_hook(lambda _g: self.end(name, "backward"))
            # without an input gradient the backward's end is invisible: then mark no backward at all
            self._bw_pending.setdefault(name, []).append(t is not None)

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, out: Any) -> None:
            self.end(name, "forward")
            pending = self._bw_pending.get(name)
            if pending and pending.pop():
                t = _first_grad_tensor(out)
                if t is not None and t.grad_fn is not None:
                    # a node pre-hook runs after the tensor hooks of the same gradient, so the next
                    # unit's backward (ended by a tensor hook on this output) closes first
                    t.grad_fn.register_prehook(lambda _g: self.begin(name, "backward"))
                elif t is not None:
                    t.register_hook(lambda _g: self.begin(name, "backward"))

        return hook

    def _active(self) -> bool:
        return self.recorder.enabled or profiler_on()

    def begin(self, name: str, phase: str) -> None:
        rec = self.recorder
        if not rec.enabled and not profiler_on():
            return
        rf = None
        if profiler_on():
            import torch

            rf = torch.autograd.profiler.record_function(f"memrt::{name}.{phase}")
            rf.__enter__()
        if rec.enabled:
            rec.record_memory(self.live_bytes(), "unit_begin", f"{name}@{phase}")
        self._open.setdefault((name, phase), []).append((time.perf_counter(), rf))

    def end(self, name: str, phase: str) -> None:
        stack = self._open.get((name, phase))
        if not stack:
            return
        start, rf = stack.pop()
        rec = self.recorder
        if rec.enabled:
            rec.record_memory(self.live_bytes(), "unit_end", f"{name}@{phase}")
            rec.record_trace(f"memrt::{name}.{phase}", start, time.perf_counter(), unit=name, phase=phase)
        if rf is not None:
            rf.__exit__(None, None, None)

    def phase(self, name: str) -> None:
        """Mark the start of a phase: forward, backward or optimizer."""
        if self.recorder.enabled:
            self.recorder.record_memory(self.live_bytes(), "phase", name)

    @contextmanager
    def step(self, index: int | None = None) -> Iterator[None]:
        """Bracket one training step (forward, backward and optimizer)."""
        rec = self.recorder
        if not rec.enabled:
            yield
            return
        label = "" if index is None else str(index)
        rec.record_memory(self.live_bytes(), "step_begin", label)
        start = time.perf_counter()
        try:
            yield
        finally:
            rec.record_memory(self.live_bytes(), "step_end", label)
            rec.record_trace("memrt::step", start, time.perf_counter(), step=label)

    def remove(self) -> None:
        """Remove every hook this marker installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "UnitMarker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def names(self) -> Iterable[str]:
        return [n for n, _ in self.units]
