"""Plans tried for compiled steps before the eager memory model's word is final (for :func:`memrt.auto`).

Two trials, both certified by measuring the compiled step (:mod:`memrt.memory.certify`):

- **torch's partitioner under a budget** (:func:`memrt.memory.compiled.graph_budget_plan`): a model compiled
  whole whose forward draws no random numbers; a miss is retried with its overshoot held back, at most
  :data:`memrt.memory.compiled.GRAPH_BUDGET_TRIES` plans per key, then the key is planned by units.
- **the floor**: every unit recomputed, put in force where the eager profile's model finds no plan (inductor's
  graphs often need less than the eager profile says) or where no profile could be made (units run inside
  the graph: an FSDP2 model compiled whole, blocks compiled in place). Its peak is measured over
  :data:`FLOOR_STEPS` steps before a miss is named.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch.nn as nn

from memrt.memory.buckets import scale_profile
from memrt.memory.compiled import GRAPH_BUDGET_TRIES, graph_budget_plan
from memrt.memory.meter import device_capacity_bytes
from memrt.memory.planner import Plan, recompute_all_plan
from memrt.memory.profile import Profile, UnitProfile

if TYPE_CHECKING:
    import torch

    from memrt.memory.instrument import Instrumentation

__all__ = ["FLOOR_STEPS", "CompiledTrials"]

logger = logging.getLogger("memrt.memory.auto")  # memrt.auto's messages keep their logger

FLOOR_STEPS = 2
"""Steps a compiled step's floor (every unit recomputed) is measured over before it is named: a peak above
the process's earlier high-water mark is read exactly, one below it from resident memory sampled every
millisecond, which can miss a short peak; the highest reading is named."""


class CompiledTrials:
    """What a model's compiled steps have tried: partitioner plans per key, keys planned by units since, and
    the floor trial in force."""

    def __init__(self, inst: Instrumentation, *, budget: int | None, device: torch.device, sharded: bool) -> None:
        self.inst = inst
        self.budget = budget
        self.device = device
        self.sharded = sharded
        """FSDP2 modules run collectives and write gradients in any backward: no shadow profile beside a
        compiled step (the step's floor is measured instead, :meth:`unprofiled_floor`)."""
        self.unpartitioned: set[str] = set()
        """Keys whose compiled step missed the budget under the partitioner's plan: planned by units now."""
        self.partitioner_tries: dict[str, int] = {}
        """Partitioner plans made per key."""
        self.floor_steps = 0
        """Steps measured over the budget under the floor trial in force (its entry stays uncertified, so the
        next step is measured too)."""
        self.warned_unprofiled = False

    # -- torch's partitioner -----------------------------------------------------------------------------
    def shadow_profiled(self) -> bool:
        """Whether a step without a plan is profiled eagerly beside the compiled step (the model is compiled
        whole and not sharded; its units' calls are traced into its graph)."""
        return self.inst.traced_step and not self.sharded and not self.inst.units_in_graph

    def partitioned(self, profile: Profile, key: str | None) -> bool:
        """Whether this step's plan may be torch's partitioner under a budget (memrt.memory.compiled): the model
        is compiled whole (its units' calls traced into its graph, profiled beside it) and its forward draws
        no random numbers."""
        return (self.budget is not None and self.shadow_profiled() and profile.draws_random is False
                and key not in self.unpartitioned)

    def partitioner_plan(self, key: str | None, profile: Profile, margin: int, scale: float) -> Plan | None:
        """A partitioner plan for ``key`` (counted), or None where the ratio it needs is out of range."""
        p = graph_budget_plan(scale_profile(profile, scale), self.budget, margin)
        if p is not None:
            self.count(key)
        return p

    def count(self, key: str | None) -> None:
        self.partitioner_tries[key] = self.partitioner_tries.get(key, 0) + 1

    def partitioner_retry(self, key: str | None, p: Plan, profile: Profile, measured: int, over: int,
                          margin: int) -> Plan | None:
        """After the partitioner's plan ``p`` measured ``over`` bytes above the budget: its retry with ``margin``
        held back (counted), or None when the key is planned by units from now on."""
        retry = None
        if self.partitioner_tries.get(key, 0) < GRAPH_BUDGET_TRIES:
            retry = graph_budget_plan(scale_profile(profile, p.shape_scale), self.budget, margin,
                                      missed=p.compiled_budget)
        then = "re-planning with that held back" if retry is not None else "planning the units' actions instead"
        logger.warning("memrt: the compiled step partitioned by torch under activation_memory_budget %s "
                       "measured %d bytes, %d over the budget; %s", p.compiled_budget, measured, over, then)
        if retry is not None:
            self.count(key)
        else:
            self.unpartitioned.add(key)
        return retry

    # -- the floor ---------------------------------------------------------------------------------------
    def floor_plan(self, profile: Profile) -> Plan | None:
        """A compiled step for which the eagerly profiled memory model finds no plan under the budget: every
        unit recomputed, to run once while certification measures its compiled step (None: not a compiled
        step, no budget, or a try that would not fit the device). Inductor's graphs often need less than the
        eager profile says (fused kernels free intermediates sooner); and where the eager model keeps a unit
        for free (the last block, whose backward runs first), a compiled backward may recompute the other
        units while that unit's tensors are still held, so under compile recomputing every unit is the floor.
        If it does not fit, the BudgetError names its measured peak as the smallest feasible budget."""
        if not self.inst.compiled_step or self.budget is None:
            return None
        p = recompute_all_plan(profile, self.budget)
        capacity = device_capacity_bytes(self.device)
        if capacity is not None and p.predicted_peak_bytes > capacity:  # not worth a try that may run out of memory
            return None
        logger.warning("memrt: the memory model predicts no plan under the budget %d bytes for this compiled step "
                       "(smallest %d bytes from the eager profile); measuring the compiled step with every unit "
                       "recomputed", self.budget, p.min_feasible_bytes)
        p.floor_trial = True
        self.floor_steps = 0
        return p

    def unprofiled_floor(self, units: Sequence[tuple[str, nn.Module]], structure: str,
                         signature: str) -> tuple[Plan, Profile]:
        """Units whose calls run inside a compiled graph, where memrt's unit calls do not run, with no profile
        beside the step (an FSDP2 model compiled whole: such a profile would run FSDP2's collectives and
        gradient reduction; units compiled in place, ``block.compile()``): every unit is recomputed inside the
        graph and the compiled step measured (a miss is a BudgetError naming the measured peak). Returns the
        floor plan and the profile that names the units."""
        log = logger.info if self.warned_unprofiled else logger.warning
        self.warned_unprofiled = True
        log("memrt: this model's units run inside a compiled graph where memrt cannot profile them one by one (an "
            "FSDP2 model compiled whole, or blocks compiled in place with module.compile()); every unit is "
            "recomputed and the compiled step measured against the budget. Compile each block with "
            "torch.compile(block) (torchtitan's way) for a plan that keeps what fits")
        profile = Profile(device=str(self.device), structure=structure, signature=signature, unprofiled=True,
                          units=[UnitProfile(index=i, name=name, has_backward=True)
                                 for i, (name, _) in enumerate(units)])
        p = recompute_all_plan(profile, self.budget)
        p.floor_trial = True
        self.floor_steps = 0
        return p, profile

    def floor_missed(self) -> bool:
        """The floor trial in force read over the budget once more: True while it is measured another step
        (the highest reading of :data:`FLOOR_STEPS` is named)."""
        self.floor_steps += 1
        return self.floor_steps < FLOOR_STEPS
