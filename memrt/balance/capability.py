"""What a rank can do: measured samples/s at its current micro-batch, and how many samples its memory holds.

Throughput is *compute* throughput: the seconds from the start of a step to the moment the rank's last
gradient bucket is ready (the DDP hook notes it), so time spent waiting for slower ranks in the
all-reduce does not count against a fast rank. Without the hook the whole step is timed.

The memory bound comes from a budget: ``(budget - fixed bytes) // bytes per sample``, where the fixed
bytes are parameters, gradients and optimizer state and the per-sample bytes are the activations saved
for backward (:func:`estimate_sample_bytes` measures them with saved-tensor hooks, or the memory
planner's plan supplies them, :func:`max_samples_from_plan`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Capability", "ThroughputMeter", "estimate_sample_bytes", "max_samples_for_budget",
           "max_samples_from_plan"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Capability:
    """One rank's figures, as all-gathered for the share decision."""

    samples_per_s: float
    """Measured compute throughput at the current micro-batch (samples per second)."""
    max_samples: int | None = None
    """Most samples per step the rank's memory budget holds; None = no bound."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.samples_per_s) and self.samples_per_s > 0):
            raise ValueError(f"samples_per_s={self.samples_per_s!r} is not valid: expected > 0")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples={self.max_samples!r} is not valid: expected >= 1 or None")


class ThroughputMeter:
    """Sliding window of (samples, seconds) per step; the first ``warmup_steps`` after a reset are ignored."""

    def __init__(self, *, window_steps: int = 8, warmup_steps: int = 1) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps={window_steps} is not valid: expected >= 1")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} is not valid: expected >= 0")
        self.window_steps = window_steps
        self.warmup_steps = warmup_steps
        self._steps: deque[tuple[int, float]] = deque(maxlen=window_steps)
        self._seen = 0

    def reset(self) -> None:
        """Forget the window (after the micro-batch changed)."""
        self._steps.clear()
        self._seen = 0

    def add(self, samples: int, seconds: float) -> None:
        self._seen += 1
        if self._seen > self.warmup_steps and seconds > 0:
            self._steps.append((samples, seconds))

    @property
    def measured_steps(self) -> int:
        return len(self._steps)

    def samples_per_s(self) -> float | None:
        """Samples over seconds in the window; None before any measured step."""
        if not self._steps:
            return None
        return sum(s for s, _ in self._steps) / sum(t for _, t in self._steps)


def max_samples_for_budget(budget_bytes: int, fixed_bytes: int, bytes_per_sample: float) -> int:
    """``(budget - fixed) // per-sample``; raises ``ValueError`` when not even one sample fits."""
    if bytes_per_sample <= 0:
        raise ValueError(f"bytes_per_sample={bytes_per_sample!r} is not valid: expected > 0")
    n = int((budget_bytes - fixed_bytes) // bytes_per_sample)
    if n < 1:
        raise ValueError(f"budget {budget_bytes} bytes holds no sample (fixed {fixed_bytes} bytes + "
                         f"{bytes_per_sample:.0f} bytes/sample): raise MEMRT_BUDGET for this rank")
    return n


def estimate_sample_bytes(model: Any, make_batch: Callable[[int], Any], loss_fn: Callable[[Any, Any], Any],
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


def max_samples_from_plan(plan: Any, micro_batch: int) -> int | None:
    """Memory bound from a memrt memory ``Plan`` made at ``micro_batch`` samples; None if it has no budget.

    The plan's peak (measured when known, else predicted) splits into a fixed part (``fixed_bytes`` when
    the plan reports it, else 0: conservative) and activations assumed linear in the micro-batch; the
    budget less the planner's ``margin_bytes`` is what may be filled.
    """
    budget = getattr(plan, "budget_bytes", None)
    peak = getattr(plan, "measured_peak_bytes", None) or getattr(plan, "predicted_peak_bytes", None)
    if not budget or not peak or micro_batch < 1:
        return None
    fixed = int(getattr(plan, "fixed_bytes", 0) or 0)
    usable = int(budget) - int(getattr(plan, "margin_bytes", 0) or 0)
    per_sample = max(1.0, (peak - fixed) / micro_batch)
    return max_samples_for_budget(usable, fixed, per_sample)
