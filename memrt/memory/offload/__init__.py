"""Offload engine: saved activations to host memory (CUDA) or disk (any device), prefetched for backward.

- :class:`OffloadEngine` — ``pack_hooks(i)``, ``packing(i)`` (a store for a recomputed unit's inputs),
  ``before_backward(i)``, ``stats()``, ``close()``.
- :func:`offload_options` — per-unit offload choices (and costs) for the planner.
- :func:`probe_bandwidths` / :func:`load_bandwidths` — measured copy and disk speeds, cached.
- :func:`offload_units` — the lower-level path: offload (or recompute + offload inputs) given modules.

Importing this package plugs the tiers into the planner and into applied plans (:mod:`.plugin`).
"""

from __future__ import annotations

from memrt.memory.offload.bandwidth import Bandwidths, load_bandwidths, probe_bandwidths
from memrt.memory.offload.engine import TIERS, OffloadEngine, OffloadStats, plan_bytes
from memrt.memory.offload.errors import OffloadError
from memrt.memory.offload.options import OFFLOAD_ACTIONS, UnitCosts, offload_options
from memrt.memory.offload.wrap import OffloadHandle, offload_units, recompute_offload
from memrt.memory.offload import plugin  # noqa: F401  (registers the tiers' options and actions)

__all__ = [
    "Bandwidths",
    "OFFLOAD_ACTIONS",
    "OffloadEngine",
    "OffloadError",
    "OffloadHandle",
    "OffloadStats",
    "TIERS",
    "UnitCosts",
    "load_bandwidths",
    "offload_options",
    "offload_units",
    "plan_bytes",
    "probe_bandwidths",
    "recompute_offload",
]
