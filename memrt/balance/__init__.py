"""memrt.balance: speed-weighted data parallelism for clusters of unequal ranks.

Each rank takes a share of every global batch in proportion to its measured samples/s (bounded by what
its memory holds); gradients are weighted by share / global batch before a SUM all-reduce, so the update
equals the full-global-batch mean gradient that uniform DDP computes. See docs/sections/mixed.md.

Two ways in over one set of parts: this API (a ``SpeedBalancer`` in the script), or none at all —
``MEMRT=1`` balances an unchanged DDP job over its own DistributedSampler / accelerate DataLoaders
(:mod:`memrt.balance.auto`; ``MEMRT_BALANCE=auto|on|off``). Both measure speeds with one meter
(:mod:`~memrt.balance.capability`), meet through one exchange (:mod:`~memrt.balance.exchange`, the process
group's store), decide with one rule (:mod:`~memrt.balance.decision`), weight gradients with one comm hook
(:mod:`~memrt.balance.hook`) and split batches with one share sampler (:mod:`~memrt.balance.loader`).
"""

from memrt.balance.balancer import BalanceConfig, Decision, SpeedBalancer
from memrt.balance.capability import (Capability, ThroughputMeter, estimate_sample_bytes, max_samples_for_budget,
                                      max_samples_from_plan)
from memrt.balance.exchange import gather_capabilities
from memrt.balance.hook import WeightedHookState, weighted_allreduce_hook
from memrt.balance.sampler import BalancedBatchSampler
from memrt.balance.shares import Shares, decide_shares, predicted_step_seconds, uniform_shares

__all__ = [
    "BalanceConfig",
    "BalancedBatchSampler",
    "Capability",
    "Decision",
    "Shares",
    "SpeedBalancer",
    "ThroughputMeter",
    "WeightedHookState",
    "decide_shares",
    "estimate_sample_bytes",
    "gather_capabilities",
    "max_samples_for_budget",
    "max_samples_from_plan",
    "predicted_step_seconds",
    "uniform_shares",
    "weighted_allreduce_hook",
]
