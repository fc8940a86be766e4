"""Which step a model is at, and whether its forwards are training steps (for :func:`memrt.auto`).

A step is the span from one training forward of the model (grad enabled) to the next such forward. A
forward whose output gets no gradient before the next forward (a validation loss computed with grad
enabled) is not a training step; its input signature is remembered as an evaluation shape (at most
:data:`EVAL_SHAPES`) and later forwards of that signature only watch for a backward. Input shapes that
differ between training steps switch planning to shape buckets (:mod:`memrt.memory.buckets`), provisionally
until the forward that made them differ turns out to be a training step.

:class:`StepTracker` only keeps this account; what to plan or measure is decided by its user
(:mod:`memrt.memory.auto`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from memrt.memory.buckets import Shape, bucket_shapes, input_shapes, signature_of
from memrt.memory.trees import tensor_leaves

__all__ = ["EVAL_SHAPES", "StepTracker"]

logger = logging.getLogger("memrt.memory.auto")  # memrt.auto's messages keep their logger

EVAL_SHAPES = 16
"""Signatures of forwards that got no backward remembered at most (the oldest are forgotten first)."""


class StepTracker:
    """The step count, the current forward's input shapes and whether its output got a gradient."""

    def __init__(self) -> None:
        self.step = 0
        """Training forwards seen (the step the model is at)."""
        self.shapes: list[Shape] = []
        """Input shapes of the current training forward."""
        self.trained_shapes: list[Shape] | None = None
        """Input shapes of the first step that got its backward."""
        self.varying = False
        """Whether training steps came with different input shapes (plans are then per shape bucket)."""
        self.provisional = False
        """Whether this forward switched to shape buckets (undone if it gets no backward)."""
        self.no_backward: dict[str, None] = {}
        """Signatures of profiled forwards that got no backward (evaluation shapes), oldest first."""
        self.watching: str | None = None
        """The signature of this forward when it is an evaluation shape (its backward is watched)."""
        self.backward_seen: bool | None = False
        """Whether backward reached the current step's output (None: the output has no tensor to watch)."""
        self._bwd_hook: Any = None

    def enter(self, args: tuple, kwargs: dict) -> str | None:
        """A training forward begins (after the previous step was closed): read its input shapes. Returns the
        signature its plan is keyed by (the bucket's bound once shapes vary), or None for an evaluation shape,
        which the plan in force serves while its backward is watched."""
        self.shapes = input_shapes(args, kwargs)
        exact = signature_of(self.shapes)
        if exact in self.no_backward:
            self.watching = exact
            self.backward_seen = False
            return None
        provisional = False
        if not self.varying and self.trained_shapes is not None and self.shapes != self.trained_shapes:
            # new shapes: buckets from now on, confirmed when this forward turns out to be a training step
            self.varying = provisional = True
        self.provisional = provisional
        return signature_of(bucket_shapes(self.shapes) if self.varying else self.shapes)

    def watch_output(self, output: Any) -> None:
        """Watch the forward's output for a gradient (once per step)."""
        if self._bwd_hook is not None:
            return
        outs = [t for t in tensor_leaves(output, into_mappings=True) if t.requires_grad]  # unregistered mappings too
        if not outs:
            self.backward_seen = None
            return
        ref = weakref.ref(self)

        def seen(_grads: Any) -> None:
            tracker = ref()
            if tracker is not None:
                tracker.backward_seen = True

        self._bwd_hook = torch.autograd.graph.register_multi_grad_hook(outs, seen, mode="any")

    def was_training(self) -> bool:
        """Whether the step ending now got its backward (or had no output to watch); stops watching."""
        seen = self.backward_seen is not False
        if self._bwd_hook is not None:
            self._bwd_hook.remove()
            self._bwd_hook = None
        self.backward_seen = False
        return seen

    def close_watch(self) -> bool:
        """End the watch of an evaluation-shape forward, if this step was one (True): a backward reached it,
        so that shape trains after all and is planned from its next step."""
        if self.watching is None:
            return False
        watched, self.watching = self.watching, None
        if self.was_training():
            self.no_backward.pop(watched, None)
        return True

    def trained(self) -> None:
        """The profiled forward got its backward: its signature is no evaluation shape."""
        self.no_backward.pop(signature_of(self.shapes), None)

    def not_a_step(self, *, profiled: bool = True) -> None:
        """The forward got no backward: shapes it made look varying do not count; ``profiled``: its
        signature is remembered as an evaluation shape."""
        if self.provisional:
            self.varying = self.provisional = False
        if not profiled:
            return
        if self.shapes:
            self.no_backward[signature_of(self.shapes)] = None
            while len(self.no_backward) > EVAL_SHAPES:
                self.no_backward.pop(next(iter(self.no_backward)))

    def note_training(self) -> None:
        """A training step ran with :attr:`shapes`: the first different shapes switch to shape buckets."""
        if self.trained_shapes is None:
            self.trained_shapes = list(self.shapes)
        elif self.provisional:
            self.provisional = False
            logger.warning("memrt: input shapes vary between training steps (%s, then %s): planning per shape "
                           "bucket (every dimension rounded up to a power of two), each bucket profiled once",
                           signature_of(self.trained_shapes), signature_of(self.shapes))
