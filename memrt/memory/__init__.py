"""memrt.memory: per-unit keep / recompute / offload under a memory budget.

``memrt.auto(model, budget)`` does everything (profile step 1, plan, apply, certify); the lower level
is ``memrt.profile(model, step_fn)`` -> ``memrt.plan(profile, budget)`` -> ``memrt.apply(model, plan)``;
``memrt.disable(model)`` removes memrt from a model; ``memrt.memory.on_plan_error(model, callback)`` turns
planning errors of a training step into a callback (memrt removed from the model) instead of an exception.
(``auto``, ``profile`` and ``apply`` are also the names of submodules here, so the functions are exported
from ``memrt`` only.)
"""

from __future__ import annotations

from memrt.memory import offload  # noqa: F401  (plugs the offload tiers into the planner and applied plans)
from memrt.memory.apply import register_action
from memrt.memory.auto import disable, on_plan_error, plan_of
from memrt.memory.options import UnitOption
from memrt.memory.planner import Plan, UnitPlan, min_feasible_budget, plan
from memrt.memory.profile import Profile, UnitProfile
from memrt.memory.units import find_units

__all__ = ["Plan", "Profile", "UnitOption", "UnitPlan", "UnitProfile", "disable", "find_units",
           "min_feasible_budget", "on_plan_error", "plan", "plan_of", "register_action"]
