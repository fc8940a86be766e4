"""What a rank can do: measured samples/s at its current micro-batch, and how many samples its memory holds.

Throughput is the rank's own work per step, never its wait for slower ranks (what is timed:
:mod:`memrt.balance.timing` under ``MEMRT=1``, the step's compute up to the last gradient bucket for a
``SpeedBalancer``); :class:`ThroughputMeter` keeps the median samples/s of the latest steps.

The memory bound comes from a budget: ``(budget - fixed bytes) // bytes per sample``, where the fixed
bytes are parameters, gradients and optimizer state and the per-sample bytes are the activations saved
for backward (:func:`estimate_sample_bytes` measures them with saved-tensor hooks, or the memory
planner's plan supplies them, :func:`max_samples_from_plan`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["Capability", "PlanFigures", "StepTiming", "ThroughputMeter", "estimate_sample_bytes",
           "max_samples_for_budget", "max_samples_from_plan"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Capability:
    """One rank's figures, as exchanged for the share decision."""

    samples_per_s: float
    """Measured compute throughput at the current micro-batch (samples per second)."""
    max_samples: int | None = None
    """Most samples per step the rank's memory budget holds; None = no bound."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.samples_per_s) and self.samples_per_s > 0):
            raise ValueError(f"samples_per_s={self.samples_per_s!r} is not valid: expected > 0")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples={self.max_samples!r} is not valid: expected >= 1 or None")


@dataclass(kw_only=True, slots=True, frozen=True)
class StepTiming:
    """One timed training step."""

    samples: int
    """Samples this rank took in the step."""
    seconds: float
    """Seconds of the step's window (between all-reduces on the host under ``MEMRT=1``, else the compute)."""
    forward_seconds: float
    """Seconds from the forward to the last gradient bucket (what every rank can time, the host as CUDA)."""


class ThroughputMeter:
    """A rank's speed: the median samples/s of its latest ``window_steps`` timed steps.

    The one speed window of both ways in (``SpeedBalancer`` and ``MEMRT=1``): the median, so a step that
    also ran something else (an evaluation, a checkpoint) does not move it. The first ``warmup_steps`` steps
    after a :meth:`reset` are not timed; :meth:`skip` leaves out the next steps without forgetting the window
    (``MEMRT=1`` after a share change: samples/s barely depend on the share, the older steps still count).
    """

    def __init__(self, *, window_steps: int = 8, warmup_steps: int = 1) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps={window_steps} is not valid: expected >= 1")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} is not valid: expected >= 0")
        self.window_steps = window_steps
        self.warmup_steps = warmup_steps
        self._steps: deque[StepTiming] = deque(maxlen=window_steps)
        self._skip = warmup_steps

    def reset(self) -> None:
        """Forget the window and skip the warm-up steps again (after the micro-batch changed)."""
        self._steps.clear()
        self._skip = self.warmup_steps

    def skip(self, steps: int) -> None:
        """Leave the next ``steps`` steps out (the window stays)."""
        self._skip = max(0, steps)

    def admit(self) -> bool:
        """Whether the step closing now is timed (False while warm-up or skipped steps remain)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def record(self, samples: int, seconds: float, forward_seconds: float | None = None) -> None:
        """Put an admitted step in the window (CUDA: once its events completed)."""
        if seconds > 0 and samples > 0:
            fwd = seconds if forward_seconds is None else forward_seconds
            self._steps.append(StepTiming(samples=samples, seconds=seconds, forward_seconds=fwd))

    def add(self, samples: int, seconds: float, forward_seconds: float | None = None) -> None:
        """One step: ``samples`` in ``seconds`` (``forward_seconds``: the forward-to-last-bucket part)."""
        if self.admit():
            self.record(samples, seconds, forward_seconds)

    @property
    def measured_steps(self) -> int:
        return len(self._steps)

    def samples_per_s(self, *, forward: bool = False) -> float | None:
        """The median samples/s of the window (``forward``: of the forward-to-last-bucket windows); None
        before any timed step."""
        rates = [t.samples / (t.forward_seconds if forward else t.seconds) for t in self._steps
                 if (t.forward_seconds if forward else t.seconds) > 0]
        return statistics.median(rates) if rates else None


def max_samples_for_budget(budget_bytes: int, fixed_bytes: int, bytes_per_sample: float) -> int:
    """``(budget - fixed) // per-sample``; raises ``ValueError`` when not even one sample fits."""
    if bytes_per_sample <= 0:
        raise ValueError(f"bytes_per_sample={bytes_per_sample!r} is not valid: expected > 0")
    n = int((budget_bytes - fixed_bytes) // bytes_per_sample)
    if n < 1:
        raise ValueError(f"budget {budget_bytes} bytes holds no sample (fixed {fixed_bytes} bytes + "
                         f"{bytes_per_sample:.0f} bytes/sample): raise MEMRT_BUDGET for this rank")
    return n


def estimate_sample_bytes(model: torch.nn.Module, make_batch: Callable[[int], tuple[Any, Any]],
                          loss_fn: Callable[[Any, Any], torch.Tensor],
                          *, batch_sizes: tuple[int, int] = (1, 2)) -> float:
    """Bytes of activations saved for backward per sample, from two forward passes (no backward).

    ``make_batch(n)`` returns ``(inputs, targets)`` of ``n`` samples; ``loss_fn(model(inputs), targets)``
    must give a scalar. Storages are counted once (views share them).
    """
    import torch

    def saved_bytes(n: int) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        inputs, targets = make_batch(n)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(inputs), targets)
        del loss
        return sum(seen.values())

    small, large = batch_sizes
    if not 0 < small < large:
        raise ValueError(f"batch_sizes={batch_sizes} is not valid: expected (small, large) with 0 < small < large")
    return max(1.0, (saved_bytes(large) - saved_bytes(small)) / (large - small))


class PlanFigures(Protocol):
    """What the memory bound reads from a memory plan (``memrt.memory.planner.Plan`` has these fields)."""

    budget_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    margin_bytes: int


def max_samples_from_plan(plan: PlanFigures, micro_batch: int) -> int | None:
    """Memory bound from a memrt memory ``Plan`` made at ``micro_batch`` samples; None if it has no budget.

    The plan's peak (measured when known, else predicted) is taken as activations linear in the
    micro-batch (no fixed part: conservative); the budget less the planner's ``margin_bytes`` is what may
    be filled.
    """
    budget = plan.budget_bytes
    peak = plan.measured_peak_bytes or plan.predicted_peak_bytes
    if not budget or not peak or micro_batch < 1:
        return None
    usable = int(budget) - int(plan.margin_bytes or 0)
    per_sample = max(1.0, peak / micro_batch)
    return max_samples_for_budget(usable, 0, per_sample)
