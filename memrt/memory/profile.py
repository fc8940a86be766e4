"""Step-1 profile: what each unit saves for backward, what it costs to recompute, and the step's peaks.

The profiling step runs every unit under recomputation (so it needs no more memory than
checkpointing every unit) and measures, per unit call: bytes saved for backward (distinct storages,
parameters excluded), bytes of its inputs, forward seconds, and the transient peaks of its forward
and backward; and for the step the peaks outside the units, as constraints on the resident bytes of
the units before them (see :mod:`memrt.memory.planner` for the memory model).
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from memrt.sizes import format_bytes
from memrt.memory.meter import Meter, make_meter
from memrt.memory.recompute import RecomputeHooks, run_recomputed
from memrt.memory.units import expect_module, find_units, structure_key

__all__ = ["Constraint", "Profile", "UnitProfile", "ProfileSession", "profile", "model_device", "storage_bytes"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class UnitProfile:
    """One call of one unit during the profiled step (a unit called twice appears twice)."""

    index: int
    """Position in the step's sequence of unit calls."""
    name: str
    """Qualified module name."""
    call: int = 0
    """Which call of this module within the step (0 for the first)."""
    saved_bytes: int = 0
    """Bytes autograd saves for backward inside the unit (distinct storages, parameters excluded)."""
    input_bytes: int = 0
    """Bytes of the unit's tensor inputs (distinct storages, parameters excluded): what recompute keeps."""
    saved_not_input_bytes: int = 0
    """Saved bytes that are not inputs (what keeping costs beyond recomputing)."""
    shared_with_previous_bytes: int = 0
    """Input bytes this unit saves that the previous unit call saves too (its output): counted once."""
    forward_seconds: float = 0.0
    """Seconds of the unit's forward (the time a recompute adds)."""
    forward_start_bytes: int = 0
    """Live bytes when the forward reaches the unit, minus the resident bytes of earlier units."""
    forward_keep_transient_bytes: int = 0
    """Peak above forward_start during the unit's forward when its saved tensors are kept."""
    forward_recompute_transient_bytes: int = 0
    """Peak above forward_start during the unit's forward when nothing is kept."""
    has_backward: bool = False
    """Whether backward reached the unit."""
    backward_start_bytes: int = 0
    """Live bytes when backward enters the unit, minus the resident bytes of this and earlier units."""
    backward_recompute_transient_bytes: int = 0
    """Peak above the backward start while the unit recomputes its forward."""
    backward_transient_bytes: int = 0
    """Peak above the backward start after the recompute, until backward leaves the unit."""


@dataclass(kw_only=True, slots=True)
class Constraint:
    """A peak outside the units' own ranges: ``bytes + resident(units[:prefix]) <= budget``."""

    prefix: int
    """Number of unit calls whose resident bytes are live at this peak."""
    bytes: int
    """Peak live bytes minus those units' resident bytes."""
    label: str
    """Where: forward, backward, optimizer."""
    shifted: bool = True
    """Whether the bytes grow with state created during step 1 (optimizer state): False for the optimizer phase."""


@dataclass(kw_only=True, slots=True)
class Profile:
    """Measured step 1. ``to_json``/``from_json`` round-trip."""

    units: list[UnitProfile] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    device: str = "cpu"
    start_live_bytes: int = 0
    """Live bytes when step 1 started (parameters, inputs, existing gradients/state)."""
    end_live_bytes: int = 0
    """Live bytes after step 1 (adds optimizer state and kept gradients): the next steps' fixed bytes."""
    param_bytes: int = 0
    """Bytes of the model's parameters and buffers."""
    peak_bytes: int = 0
    """Measured peak of the profiling step (every unit recomputed)."""
    step_seconds: float = 0.0
    """Wall time of the profiling step."""
    structure: str = ""
    """Digest of the model structure (cache key part)."""
    signature: str = ""
    """Input shapes and dtypes (cache key part)."""
    unprofiled: bool = False
    """The units are named only: their calls ran inside a compiled graph, where memrt measures nothing per
    unit. A plan made from it is the measured floor (every unit recomputed), kept in memory only."""
    draws_random: bool | None = None
    """Whether the profiled forward drew random numbers (dropout, noise: an operator torch tags
    ``nondeterministic_seeded`` ran, or a default generator moved): a compiled graph of such a model is never
    partitioned under an activation memory budget (memrt.memory.compiled). None: not recorded (an eager profile)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | dict) -> "Profile":
        d = json.loads(text) if isinstance(text, str) else dict(text)
        d["units"] = [UnitProfile(**u) for u in d.get("units", [])]
        d["constraints"] = [Constraint(**c) for c in d.get("constraints", [])]
        return cls(**d)

    def __str__(self) -> str:
        head = f"{'#':>3} {'unit':<24} {'saved MiB':>9} {'input MiB':>9} {'fwd ms':>8}"
        rows = [head] + [f"{u.index:>3} {u.name + (f'@{u.call}' if u.call else ''):<24} {u.saved_bytes / 2**20:>9.2f} "
                         f"{u.input_bytes / 2**20:>9.2f} {u.forward_seconds * 1e3:>8.2f}" for u in self.units]
        rows.append(f"fixed {format_bytes(self.end_live_bytes)}, profiled peak {format_bytes(self.peak_bytes)}, "
                    f"step {self.step_seconds * 1e3:.1f} ms")
        return "\n".join(rows)


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def storage_bytes(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage of ``tensors``, by storage id (tensors without a storage are left out)."""
    out: dict[int, int] = {}
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        out[s._cdata] = s.nbytes()
    return out


class _UnitHooks(RecomputeHooks):
    def __init__(self, session: "ProfileSession", up: UnitProfile, exclude: set[int]) -> None:
        self.session, self.up, self.exclude = session, up, exclude
        self.saved: dict[int, tuple[int, int]] = {}
        self.refs: dict[int, weakref.ref] = {}

    def on_pack(self, t: torch.Tensor) -> None:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        k = s._cdata
        if k in self.exclude:
            return
        ref = self.refs.get(k)
        if ref is not None and ref() is s:
            return
        # a new storage (an address can be reused once the tensors saved earlier are freed)
        self.refs[k] = weakref.ref(s)
        self.saved[len(self.saved)] = (k, s.nbytes())
        self.session.meter.ghost(t)

    def on_begin(self) -> None:
        self.session._bwd_event("recompute_begin", self.up.index)

    def on_end(self) -> None:
        self.session._bwd_event("recompute_end", self.up.index)


class ProfileSession:
    """Measures one step; the instrumentation calls :meth:`unit_call` for every unit call."""

    def __init__(self, model: nn.Module, units: Sequence[tuple[str, nn.Module]], *, device: torch.device) -> None:
        self.units, self.device = list(units), device
        self._model = weakref.ref(model)
        self.meter: Meter = make_meter(device)
        self.profile = Profile(device=str(device), structure=structure_key(model, units))
        self.param_ids = set(storage_bytes(list(model.parameters()) + list(model.buffers())))
        self.profile.param_bytes = sum(storage_bytes(list(model.parameters()) + list(model.buffers())).values())
        self._prefix_inputs = [0]  # cumulative input bytes of unit calls
        self._calls: dict[str, int] = {}
        self._state: tuple[str, int] = ("fwd", 0)
        self._bwd_seen = False
        self._bwd_start: dict[int, int] = {}
        self._recompute_peak: dict[int, int] = {}
        self._overhead = 0.0
        self._prev_saved: dict[int, weakref.ref] = {}
        self._t0 = 0.0
        self._done = False
        self._hooks: list[Any] = []

    # -- step boundaries ----------------------------------------------------------------------------
    def begin(self, inputs: Any = ()) -> None:
        if self.device.type == "cpu":
            from memrt.profiling.cpu_tracker import dispatch_overhead_seconds

            self._overhead = dispatch_overhead_seconds()
        from memrt.memory.meter import known_tensors

        self.meter.start(known_tensors(self._model(), _tensors(inputs)))
        self.profile.start_live_bytes = self.meter.live()
        self.meter.mark("step_begin", "profile")
        self.meter.mark("phase", "forward")
        self._t0 = time.perf_counter()

    def end(self, next_inputs: Sequence[torch.Tensor] = ()) -> Profile:
        """Close the step (call after the optimizer step, or at the next step's start with that step's
        inputs: a paused meter did not see them made, and they are part of every step's fixed bytes)."""
        if self._done:
            return self.profile
        self._done = True
        self.meter.track(next_inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile.step_seconds = time.perf_counter() - self._t0
        self._close_segment()
        self.meter.mark("step_end", "profile")
        self.profile.end_live_bytes = self.meter.live()
        self.profile.peak_bytes = self.meter.peak
        self.meter.stop()
        for h in self._hooks:  # hooks on tensors that never got a gradient would stay registered
            h.remove()
        self._hooks.clear()
        for u in self.profile.units:
            if u.forward_seconds < 0:
                u.forward_seconds = 0.0
        return self.profile

    # -- segments -----------------------------------------------------------------------------------
    def _close_segment(self) -> int:
        """Close the current outside-units segment and add its constraint; returns its peak."""
        peak, _ = self.meter.segment()
        kind, k = self._state
        pre = self._prefix_inputs
        if kind == "fwd":  # before unit call k in forward (k == n: after the last unit)
            self.profile.constraints.append(Constraint(prefix=k, bytes=peak - pre[k], label="forward"))
        elif kind == "bwd_in":  # inside unit k's backward
            up = self.profile.units[k]
            start = self._bwd_start[k]
            rp = self._recompute_peak.get(k)
            if rp is None:
                up.backward_recompute_transient_bytes = max(up.backward_recompute_transient_bytes, peak - start)
            else:
                up.backward_transient_bytes = max(up.backward_transient_bytes, peak - start)
        elif kind == "bwd_out":  # after unit k's backward: units < k still resident
            self.profile.constraints.append(Constraint(prefix=k, bytes=peak - pre[k], label="backward"))
        elif kind == "tail":
            self.profile.constraints.append(Constraint(prefix=0, bytes=peak, label="optimizer", shifted=False))
        return peak

    def _bwd_event(self, what: str, k: int) -> None:
        if not self._bwd_seen:
            self._bwd_seen = True
            self._close_segment()
            self.meter.mark("phase", "backward")
            self._state = ("bwd_out", len(self.profile.units))
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._bwd_done)
            except RuntimeError:  # not inside backward (should not happen)
                pass
        up = self.profile.units[k]
        if what == "enter":
            if self._state == ("bwd_in", k):
                return
            self._close_segment()
            self.meter.mark("unit_begin", f"{up.name}@backward")
            live = self.meter.live()
            self._bwd_start[k] = live
            up.has_backward = True
            up.backward_start_bytes = live - self._prefix_inputs[k + 1]
            self._state = ("bwd_in", k)
        elif what == "recompute_begin":
            if self._state != ("bwd_in", k):  # recompute triggered without a seen entry
                self._bwd_event("enter", k)
            self.meter.mark("recompute", up.name)
        elif what == "recompute_end":
            peak, _ = self.meter.segment()
            start = self._bwd_start.get(k, self.meter.live())
            up.backward_recompute_transient_bytes = max(up.backward_recompute_transient_bytes, peak - start)
            self._recompute_peak[k] = peak
        elif what == "exit":
            if self._state != ("bwd_in", k):
                return
            self._close_segment()
            self.meter.mark("unit_end", f"{up.name}@backward")
            self._state = ("bwd_out", k)

    def _bwd_done(self) -> None:
        self._close_segment()
        self.meter.mark("phase", "optimizer")
        self._state = ("tail", 0)

    # -- unit calls ---------------------------------------------------------------------------------
    def unit_call(self, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled() or self._bwd_seen:
            return fn(*args, **kwargs)
        k = len(self.profile.units)
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        self._state = ("fwd", k)
        self._close_segment()
        inputs = storage_bytes([t for t in _tensors((args, kwargs))])
        in_bytes = sum(n for s, n in inputs.items() if s not in self.param_ids)
        up = UnitProfile(index=k, name=name, call=call, input_bytes=in_bytes)
        self.profile.units.append(up)
        self._prefix_inputs.append(self._prefix_inputs[-1] + in_bytes)
        self.meter.mark("unit_begin", f"{name}@forward")
        start = self.meter.live()
        up.forward_start_bytes = start - self._prefix_inputs[k]
        hooks = _UnitHooks(self, up, self.param_ids)
        ops0 = getattr(getattr(self.meter, "tracker", None), "ops", 0)
        if self.device.type == "cuda":
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        t0 = time.perf_counter()
        out = run_recomputed(fn, args, kwargs, module=module, name=name, hooks=hooks)
        dt = time.perf_counter() - t0
        if self.device.type == "cuda":
            ev1.record()
            ev1.synchronize()
            dt = ev0.elapsed_time(ev1) / 1e3
        else:
            ops = getattr(getattr(self.meter, "tracker", None), "ops", 0) - ops0
            dt = max(dt * 0.05, dt - ops * self._overhead)
        up.forward_seconds = dt
        peak, ghost_peak = self.meter.segment()
        self.meter.clear_ghosts()
        up.saved_bytes = sum(n for _, n in hooks.saved.values())
        prev, self._prev_saved = self._prev_saved, hooks.refs
        up.shared_with_previous_bytes = sum(
            n for s, n in hooks.saved.values()
            if s in inputs and s in prev and prev[s]() is not None and prev[s]() is hooks.refs.get(s, lambda: None)())
        up.saved_not_input_bytes = sum(n for s, n in hooks.saved.values() if s not in inputs)
        up.forward_recompute_transient_bytes = max(0, peak - start)
        if self.meter.exact_ghosts:
            up.forward_keep_transient_bytes = max(0, ghost_peak - start)
        else:  # upper bound: transients plus everything saved
            up.forward_keep_transient_bytes = max(0, peak - start) + up.saved_not_input_bytes
        self.meter.mark("unit_end", f"{name}@forward")
        self._state = ("fwd", k + 1)
        self._watch_backward(k, args, kwargs, out)
        return out

    def _watch_backward(self, k: int, args: tuple, kwargs: dict, out: Any) -> None:
        outs = [t for t in _tensors(out) if t.requires_grad]
        if not outs:
            return
        # weak: a hook left on a tensor that outlives the step must not keep the session (and the model)
        ref = weakref.ref(self)

        def event(what: str) -> Callable[[Any], None]:
            def hook(_grads: Any) -> None:
                session = ref()
                if session is not None:
                    session._bwd_event(what, k)
            return hook

        reg = torch.autograd.graph.register_multi_grad_hook
        self._hooks.append(reg(outs, event("enter"), mode="any"))
        ins = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if ins:
            self._hooks.append(reg(ins, event("exit"), mode="all"))


def profile(model: nn.Module, step_fn: Callable[[], Any], *, units: Sequence[str] | None = None) -> Profile:
    """Run ``step_fn()`` (one full training step: forward, backward, optimizer) once under measurement.

    Every unit is recomputed during this step; returns the :class:`Profile` for :func:`memrt.plan`.
    """
    from memrt.memory.instrument import Instrumentation
    from memrt.memory.meter import watch_optimizers

    expect_module("memrt.profile", model)
    if not callable(step_fn):
        raise TypeError(f"memrt.profile expects step_fn, a callable running one training step, got "
                        f"{type(step_fn).__name__}")

    watch_optimizers()
    device = model_device(model)
    found = find_units(model, units)
    session = ProfileSession(model, found, device=device)
    inst = Instrumentation(model, found, unit_call=session.unit_call)
    try:
        session.begin()
        step_fn()
        return session.end()
    finally:
        session.end()
        inst.remove()
