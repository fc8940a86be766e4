"""memrt: memory and communication optimization runtime for PyTorch training.

Importing ``memrt`` is cheap: the memory planner, comm and profiling load on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from memrt._version import __version__
from memrt.config import Budget, MemrtConfig, load_config
from memrt.errors import BudgetError, ConfigError, MemrtError
from memrt.launcher import LaunchInfo, discover_launch

# Public name -> module that defines it (imported on first access, keeps `import memrt` torch-free).
_LAZY = {
    "auto": "memrt.memory.auto",
    "plan_of": "memrt.memory.auto",
    "disable": "memrt.memory.auto",
    "profile": "memrt.memory.profile",
    "plan": "memrt.memory.planner",
    "apply": "memrt.memory.apply",
    "Plan": "memrt.memory.planner",
    "Profile": "memrt.memory.profile",
    "SpeedBalancer": "memrt.balance",
    "BalancedBatchSampler": "memrt.balance",
}

__all__ = [
    "__version__",
    "Budget",
    "BudgetError",
    "ConfigError",
    "LaunchInfo",
    "MemrtConfig",
    "MemrtError",
    "discover_launch",
    "load_config",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
