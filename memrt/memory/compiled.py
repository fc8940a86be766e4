"""memrt's plans under ``torch.compile``: the plan is kept, expressed in what dynamo understands.

Two cases, one mechanism: ``torch.compile(model)`` of a model :func:`memrt.auto` instruments, and
``memrt.auto(torch.compile(model))`` (auto then instruments the compiled module's original model).
A model whose blocks are compiled one by one (``torch.compile(block)``, torchtitan's way) runs its units
outside any graph: it is profiled and planned as an eager model (a recomputed unit replays its compiled
forward), and measured as compiled steps are.

- **Step boundary**: memrt's step hook runs outside the graph (``torch._dynamo.disable``); it is told
  whether the step it starts is being compiled (``torch.compiler.is_compiling()`` is evaluated in
  the traced part of the hook).
- **Units inside the graph** (:func:`memrt.memory.instrument.compiled_unit_call`): ``keep`` calls the unit; ``recompute`` wraps
  it in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which dynamo turns into a
  checkpointed region (AOTAutograd recomputes it in backward). Offload actions cannot be carried
  by a compiled graph (saved-tensor hooks that move data do not trace): such a unit is recomputed
  instead, logged once with the reason.
- **The whole graph partitioned by torch** (:func:`graph_budget_plan`): a model compiled whole whose forward
  draws no random numbers may instead be planned as one ``activation_memory_budget`` for its graph: every unit
  is called as it is and inductor's partitioner chooses, operator by operator, what the backward recomputes (a
  knapsack over each saved tensor's size and recompute cost). memrt maps its budget onto the partitioner's
  ratio between its eager profile's every-unit-recomputed and keep-all peaks and holds torch's setting from
  the start of each compiled forward of the model to its end, when the forward's graphs are compiled
  (:func:`memrt.memory.instrument.patch_partitioner` in the step hook, ``restore_partitioner`` in the output
  hook: graphs the job compiles elsewhere keep their own setting), and certifies the compiled step as any
  plan; a miss is retried once at a lower ratio, then the units' own plan takes over. A forward that draws
  random numbers keeps per-unit regions: under a budget below 1.0 torch 2.13's partitioner may recompute a
  random operator in the backward with fresh random numbers (a different dropout mask than the forward used:
  wrong gradients, pytorch/pytorch#190758), while a checkpointed region replays the random state it saved.
- **Profile**: memrt's eager profile needs its per-unit hooks, which a compiled step does not run.
  For a compiled step without a plan, :func:`shadow_profile` profiles one eager forward and backward
  of the same inputs first: gradients through ``torch.autograd.grad`` (no ``.grad`` is touched), the
  user's random generators forked and restored, buffers restored. The real step then runs compiled
  with the plan, and certification measures the compiled steps that follow: allocator statistics on
  CUDA; on CPU :class:`CompiledCpuMeter` (resident memory), because memrt's CPU tracker (a dispatch mode
  dynamo lets compiled code run under) does not see the buffers inductor allocates directly. An FSDP2
  model compiled whole gets no profile (one beside the step would run FSDP2's collectives and gradient
  reduction): every unit is recomputed and the compiled step measured.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from memrt.memory.meter import Meter, graphs_compiled, status_bytes
from memrt.memory.trees import tensor_leaves

__all__ = ["compiled_action", "shadow_profile", "COMPILED_ACTIONS", "CompiledCpuMeter",
           "compiled_meter", "graph_budget_plan", "GRAPH_BUDGET_MIN", "GRAPH_BUDGET_TRIES", "GRAPH_BUDGET_RETRY"]

COMPILED_ACTIONS = ("keep", "recompute")
"""What a unit can do inside a compiled graph; every other action falls back to ``recompute``."""


def compiled_action(action: str) -> str:
    """The action a compiled graph runs for a planned ``action`` (offload -> recompute)."""
    return action if action in COMPILED_ACTIONS else "recompute"


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tensor_leaves(out) if t.requires_grad]


def shadow_profile(model: nn.Module, units: Sequence[tuple[str, nn.Module]], device: torch.device,
                   args: tuple, kwargs: dict, override: Callable[[Any], None]) -> Any:
    """Profile one eager forward + backward of ``model`` on ``args`` without changing any user state.

    ``override(unit_call or None)`` installs the profile's unit call on memrt's instrumentation.
    Returns the :class:`memrt.memory.profile.Profile`.
    """
    from memrt.memory.profile import ProfileSession

    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device.index or 0] if device.type == "cuda" else []
    session = ProfileSession(model, units, device=device)
    override(session.unit_call)
    try:
        with torch.random.fork_rng(devices=devices):
            session.begin((args, kwargs))
            before = _random_states(devices)
            with _RandomOps() as random_ops:
                out = model.forward(*args, **kwargs)  # forward, not __call__: memrt's step hook stays out
            session.profile.draws_random = random_ops.seen or not all(
                torch.equal(a, b) for a, b in zip(before, _random_states(devices)))
            outs = _grad_outputs(out)
            if outs and params:
                grads = torch.autograd.grad(outs, params, grad_outputs=[torch.ones_like(t) for t in outs],
                                            allow_unused=True)
                del grads
            del out, outs
            return session.end()
    finally:
        session.end()
        override(None)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _random_states(devices: list[int]) -> list[torch.Tensor]:
    """The default generators' states (CPU and the given CUDA devices): a forward that draws moves them."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]


class _RandomOps(TorchDispatchMode):
    """Sees whether any operator that draws random numbers runs, whatever generator it draws from: torch tags such
    operators ``nondeterministic_seeded``; an attention kernel so tagged draws only where its ``dropout_p`` is not
    0 (CPU's flash attention is tagged at 0 too)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.seen and torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = _dropout_p(func, args, kwargs) != 0
        return func(*args, **kwargs)


def _dropout_p(func: Any, args: tuple, kwargs: dict) -> Any:
    """The ``dropout_p`` argument of an operator call (None where the operator has none)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            return args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
    return None


# ------------------------------------------------------------------------ the partitioner's budget
GRAPH_BUDGET_MIN = 0.05
"""The smallest partitioner ratio memrt plans with. Near 0 the partitioner saves little more than the graph's
inputs and the backward recomputes the forward at its start, holding as much as keeping everything; budgets
that low are served by recomputing units as checkpointed regions."""

GRAPH_BUDGET_TRIES = 2
"""Partitioner plans tried per key (the second holds back the first one's overshoot) before memrt plans the
units' actions instead."""

GRAPH_BUDGET_RETRY = 0.8
"""A retry's ratio is at most this fraction of the one that missed: the partitioner's choice moves in steps (a
saved tensor more or less), so a ratio lowered by the overshoot alone often picks the same tensors again."""


def graph_budget_plan(profile: Any, budget: int, margin_bytes: int = 0, *, missed: float | None = None) -> Any:
    """The plan that partitions a compiled graph under the ratio placing its peak at ``budget - margin_bytes``
    between the eager profile's every-unit-recomputed and keep-all peaks (after a miss at ratio ``missed``: at
    most :data:`GRAPH_BUDGET_RETRY` of it), or None where that ratio is 1 (everything fits kept: the units'
    plan keeps all) or under :data:`GRAPH_BUDGET_MIN`."""
    from memrt.memory.planner import recompute_all_plan

    p = recompute_all_plan(profile, budget)
    low, high = p.predicted_peak_bytes, p.keep_all_peak_bytes
    target = int(budget) - int(margin_bytes)
    if high <= low or target >= high:
        return None
    ratio = round((target - low) / (high - low), 3)
    if missed is not None:
        ratio = min(ratio, round(GRAPH_BUDGET_RETRY * missed, 3))
    if ratio < GRAPH_BUDGET_MIN:
        return None
    for u in p.units:
        u.action, u.bytes_kept, u.bytes_freed, u.added_seconds = "keep", u.bytes_kept + u.bytes_freed, 0, 0.0
    p.compiled_budget = ratio
    p.predicted_peak_bytes = int(low + ratio * (high - low))
    p.margin_bytes = int(margin_bytes)
    return p


# ----------------------------------------------------------------------------------------- measuring
def _status_bytes(field: str) -> int:
    value = status_bytes(field)
    if value is None:
        raise RuntimeError(f"no {field} in /proc/self/status: measuring a compiled CPU step needs Linux")
    return value


class _RssSampler:
    """The highest resident set size seen by polling ``/proc/self/statm`` every ``interval_s`` on a thread."""

    def __init__(self, interval_s: float = 0.001) -> None:
        import os
        import threading

        self.interval_s = interval_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.highest = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memrt-rss-sampler", daemon=True)
        self._thread.start()

    def read(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.highest = max(self.highest, self.read())

    def stop(self) -> int:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.highest = max(self.highest, self.read())
        return self.highest


class CompiledCpuMeter(Meter):
    """The peak of a compiled CPU step from resident memory (a dispatch mode does not see inductor's buffers).

    ``peak`` = bytes of the tensors known at the start (parameters, inputs, optimizer state) + the growth
    of the process's resident memory over the step. The growth is exact when the kernel's high-water mark
    (``VmHWM``) rose during the step (the step's peak is then the new mark); otherwise an earlier moment of
    the process was higher, and the step's own peak is the highest resident size a thread sampled every
    millisecond (a peak shorter than that can be missed). The mark is never reset: that would change what
    ``ru_maxrss`` and ``VmHWM`` tell the user. Meaningful with glibc returning large blocks to the OS
    (``MALLOC_MMAP_THRESHOLD_=65536``, as memrt's CPU budget is defined); frozen at :meth:`pause` (the
    optimizer step is not the step's).
    """

    exact_ghosts = False

    def __init__(self) -> None:
        self._known = 0
        self._rss0 = 0
        self._hwm0 = 0
        self._sampler: _RssSampler | None = None
        self._frozen: int | None = None
        self._graphs = 0

    @property
    def valid(self) -> bool:
        """False when torch compiled during the step (forward or backward graph): compiling's own memory is not
        the step's."""
        return graphs_compiled() == self._graphs

    def start(self, extra: Any = ()) -> None:
        from memrt.memory.profile import storage_bytes

        self._graphs = graphs_compiled()
        self._known = sum(storage_bytes([t for t in extra if isinstance(t, torch.Tensor)]).values())
        self._rss0 = _status_bytes("VmRSS")
        self._hwm0 = _status_bytes("VmHWM")
        self._sampler = _RssSampler()
        self._frozen = None

    def _now(self) -> int:
        hwm = _status_bytes("VmHWM")
        if hwm > self._hwm0:
            top = hwm
        else:
            top = self._sampler.highest if self._sampler is not None else _status_bytes("VmRSS")
        return self._known + max(0, top - self._rss0)

    def pause(self) -> None:
        if self._frozen is None:
            if self._sampler is not None:
                self._sampler.stop()
            self._frozen = self._now()
            self._sampler = None

    def stop(self) -> None:
        self.pause()

    def live(self) -> int:
        return self._known + max(0, _status_bytes("VmRSS") - self._rss0)

    def segment(self) -> tuple[int, int]:
        return self.live(), self.peak

    def mark(self, kind: str, label: str = "") -> None: ...
    def track(self, tensors: Any) -> None: ...
    def ghost(self, t: torch.Tensor) -> None: ...
    def clear_ghosts(self) -> None: ...

    @property
    def peak(self) -> int:
        return self._frozen if self._frozen is not None else self._now()


def compiled_meter(device: torch.device) -> Meter:
    """The meter for a compiled step: allocator statistics on CUDA, :class:`CompiledCpuMeter` on CPU."""
    if device.type == "cpu":
        return CompiledCpuMeter()
    from memrt.memory.meter import make_meter

    return make_meter(device)
