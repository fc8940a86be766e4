"""How the offload tiers plug into the planner and into applied plans: one option source, two actions.

Importing :mod:`memrt.memory.offload` registers them; the planner (:mod:`memrt.memory.planner`) and the
plan applier (:mod:`memrt.memory.apply`) never import the tiers.

- options (:func:`memrt.memory.options.register_options`): per unit, offload to each tier usable in this
  process (host needs CUDA, disk a usable folder), priced by the measured bandwidths; a plan that writes
  more to the disk folder than it has room for is refused, and the planner plans again without disk.
- actions (:func:`memrt.memory.apply.register_action`): ``offload_<tier>`` and ``recompute+offload_<tier>``,
  run through one :class:`~memrt.memory.offload.engine.OffloadEngine` per tier and applied plan.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch.nn as nn

from memrt.memory.apply import ActionHandler, ApplyContext, register_action
from memrt.memory.offload.bandwidth import load_bandwidths
from memrt.memory.offload.engine import OffloadEngine, plan_bytes
from memrt.memory.offload.folder import room_for, usable_tiers
from memrt.memory.offload.options import offload_options
from memrt.memory.offload.wrap import notify_before_backward
from memrt.memory.options import OptionSource, UnitOption, register_options
from memrt.memory.recompute import run_recomputed

if TYPE_CHECKING:
    from memrt.config import MemrtConfig
    from memrt.memory.offload.bandwidth import Bandwidths
    from memrt.memory.planner import Plan
    from memrt.memory.profile import Profile, UnitProfile

__all__ = ["engine_for"]

logger = logging.getLogger(__name__)


def _propose(profile: Profile, offload: str, bandwidths: Bandwidths | None,
             config: MemrtConfig | None) -> Callable[[UnitProfile], Sequence[UnitOption]] | None:
    tiers = usable_tiers(profile, offload, profile.device, config)
    if not tiers:
        return None
    if bandwidths is None:
        try:  # priced for the filesystem the disk tier will write to
            bandwidths = load_bandwidths(profile.device, config.offload_dir if config is not None else None)
        except Exception as exc:  # noqa: BLE001 - a failed probe only removes offload options
            logger.warning("offload bandwidth probe failed (%s): planning keep/recompute only", exc)
            return None
    return lambda u: offload_options(u, bandwidths, profile.device, tiers=tiers)


def _admit(plan: Plan, config: MemrtConfig | None) -> bool:
    """A plan that writes to disk needs room in the folder (reserved here); no room: plan without disk."""
    return not any(u.action.endswith("offload_disk") for u in plan.units) or room_for(plan, config)


def engine_for(ctx: ApplyContext, tier: str) -> OffloadEngine:
    """The applied plan's engine of ``tier``, made on first use and sized by the plan (free-space check,
    pinned pool); :meth:`ApplyContext.close` closes it."""
    if tier not in ctx.engines:
        ctx.engines[tier] = OffloadEngine(tier, device=ctx.device, directory=ctx.offload_dir, keep=ctx.model,
                                          required_bytes=plan_bytes(ctx.plan, tier))
    return ctx.engines[tier]


def _offload(ctx: ApplyContext, action: str) -> ActionHandler:
    recompute = action.startswith("recompute+")
    tier = action.split("offload_", 1)[1]

    def handler(i: int, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        engine = engine_for(ctx, tier)
        if recompute:
            with engine.packing(i) as store:
                out = run_recomputed(fn, args, kwargs, module=module, name=name, store=store)
            notify_before_backward(out, engine, i)
            return out
        with engine.pack_hooks(i):
            out = fn(*args, **kwargs)
        notify_before_backward(out, engine, i)
        return out

    return handler


register_options(OptionSource("offload", _propose, _admit))
register_action("offload_", _offload)
register_action("recompute+offload_", _offload)
