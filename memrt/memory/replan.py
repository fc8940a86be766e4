"""Making the plan for the key in force under :func:`memrt.auto`, with its fallbacks.

In order: torch's partitioner under a budget where the compiled step may use it
(:class:`memrt.memory.trials.CompiledTrials`); else the units' plan (:func:`memrt.memory.planner.plan`) for the
profile scaled to the largest shape of its bucket; where that does not fit, the plan for the profiled shape
itself; where nothing fits, a compiled step's floor trial; else :class:`memrt.BudgetError` and no plan in force.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from memrt.errors import BudgetError
from memrt.memory.buckets import scale_profile
from memrt.memory.inforce import PlanInForce
from memrt.memory.planner import plan as make_plan
from memrt.memory.profile import Profile
from memrt.memory.trials import CompiledTrials

if TYPE_CHECKING:
    from memrt.config import MemrtConfig

__all__ = ["MAX_TRIES", "PlanMaker"]

logger = logging.getLogger("memrt.memory.auto")  # memrt.auto's messages keep their logger

MAX_TRIES = 3
"""Plans made per key before an overshoot of the budget is an error."""


class PlanMaker:
    """Makes plans for a model under one budget and offload setting and puts them in force."""

    def __init__(self, inforce: PlanInForce, trials: CompiledTrials, *, budget: int | None, offload: str,
                 config: MemrtConfig) -> None:
        self.inforce = inforce
        self.trials = trials
        self.budget = budget
        self.offload = offload
        self.config = config
        """The settings this model is planned and offloaded under (the offload folder, strict)."""

    def make(self, profile: Profile, *, margin: int, tries: int, scale: float = 1.0) -> None:
        """Plan from ``profile`` (its activation bytes times ``scale``) with ``margin`` bytes held back, as the
        key's ``tries``-th plan, and put the plan in force. Raises :class:`memrt.BudgetError` (no plan in force
        then) where nothing fits."""
        if self.trials.partitioned(profile, self.inforce.key):
            p = self.trials.partitioner_plan(self.inforce.key, profile, margin, scale)
            if p is not None:
                self.inforce.use(p, profile, tries=tries, scale=scale)
                return
        try:
            p = make_plan(scale_profile(profile, scale), self.budget, margin_bytes=margin, offload=self.offload,
                          config=self.config)
        except BudgetError:
            if scale > 1.0:  # the bucket's largest shape does not fit by the model: plan for the shape seen
                logger.warning("memrt: no plan fits %s (the largest shape of its bucket) under the budget; "
                               "planning for the profiled shape %s and certifying larger ones as they come",
                               self.inforce.signature, profile.signature)
                self.make(profile, margin=margin, tries=tries, scale=1.0)
                return
            floor = self.trials.floor_plan(profile)
            if floor is not None:
                self.inforce.use(floor, profile, tries=MAX_TRIES, scale=1.0)  # a miss is final: no plan saves more
                return
            self.inforce.drop()
            raise
        self.inforce.use(p, profile, tries=tries, scale=scale)
