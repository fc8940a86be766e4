"""Applying shares under ``MEMRT=1``: the job's balanced DataLoaders and the gradient factor of each step.

:class:`LoaderFeed` holds the share samplers of the DataLoaders the job built (weakly, in creation order: the
same on every rank), says where each one's draws stand (the figures an exchange carries), notes which of them
fed a training step and the gradient factor of the batch that step consumed, and schedules a decision's new
shares on them from the first batch no rank has drawn yet.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from memrt.balance.loader import ShareSampler
from memrt.balance.shares import Shares, uniform_shares

__all__ = ["LoaderFeed"]

logger = logging.getLogger("memrt.balance")

GONE = [-2, 0, 0, False, 0]
"""A dropped DataLoader's figures in an exchange."""


class LoaderFeed:
    """The balanced DataLoaders of one process and the factor of the current step's batch."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._refs: list[weakref.ref[ShareSampler]] = []
        self.skipped: dict[str, int] = {}
        """Why DataLoaders were left as they are -> how many."""
        self.factor = 1.0
        """Gradient factor of this step's batch (n_r * W / B, or exactly 1 under the stock split)."""
        self.step_samples = 0
        """Samples of the batches the latest step consumed (1 when no balanced DataLoader fed it: steps/s)."""
        self.accum = 1
        """Batches per optimizer step seen (gradient accumulation)."""
        self._marks: dict[int, tuple[int, int]] = {}
        self._warned: set[str] = set()

    def add(self, sampler: ShareSampler) -> None:
        self._refs.append(weakref.ref(sampler))

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    @property
    def loaders(self) -> list[ShareSampler | None]:
        """The share samplers by creation index; None where the DataLoader is gone."""
        return [ref() for ref in self._refs]

    def figures(self) -> list[list[Any]]:
        """Per loader: [iteration, drawn, consumed, trained, full batch] (what the exchange carries)."""
        return [list(GONE) if s is None else [s.iteration, s.drawn, s.consumed, s.trained, s.full_batch()]
                for s in self.loaders]

    def mark_step(self) -> int:
        """A gradient all-reduce began: the loaders whose batches were consumed since the last one fed this
        step. Sets :attr:`factor` and returns the step's samples."""
        factors, samples, consumed = set(), 0, 0
        for i, s in enumerate(self.loaders):
            if s is None:
                continue
            mark = (s.iteration, s.consumed)
            if mark != self._marks.get(i) and s.current is not None:
                s.trained = True
                before = self._marks.get(i)
                consumed = s.consumed - (before[1] if before and before[0] == s.iteration else 0)
                factors.add(s.current[0])
                samples += s.current[1] * max(1, consumed)
            self._marks[i] = mark
        if consumed > 0:
            self.accum = consumed
        self.step_samples = samples or 1  # no balanced DataLoader: steps/s (ranks take equal batches)
        if len(factors) > 1 and "factors" not in self._warned:
            self._warned.add("factors")
            logger.warning("memrt: balance: several DataLoaders with different shares fed one step: their "
                           "gradients are weighted by the first one's share")
        self.factor = next(iter(factors)) if factors else 1.0
        return self.step_samples

    def lag_steps(self) -> int:
        """Batches already drawn ahead of the training loop (prefetch): new shares arrive that much later."""
        return max((s.drawn - s.consumed for s in self.loaders if s is not None and s.trained), default=0)

    def apply(self, decision: dict[str, Any]) -> None:
        """Schedule a decision's changes: loader i splits by its shares from its ``from`` position on."""
        loaders = self.loaders
        for change in decision.get("loaders", ()):
            sampler = loaders[change["loader"]]
            if sampler is None:
                continue
            B = change["global_batch"]
            shares = Shares(per_rank=tuple(change["shares"]), global_batch=B)
            new = None if shares == uniform_shares(B, self.world) else shares.per_rank
            sampler.schedule(tuple(change["from"]), new, decision["reduction"])

    def samples_seen(self) -> list[int | None]:
        return [None if s is None else s.samples_seen for s in self.loaders]
