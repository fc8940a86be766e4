"""The state of every random number generator a user can see, for tests that memrt leaves them alone.

:func:`rng_states` returns torch's CPU generator, every initialised CUDA device's generator, numpy's
global state and Python's ``random`` state as comparable values; :func:`rng_digest` hashes them.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

__all__ = ["rng_states", "rng_digest", "changed_generators"]


def rng_states() -> dict[str, Any]:
    out: dict[str, Any] = {"torch_cpu": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"torch_cuda{i}"] = torch.cuda.get_rng_state(i).numpy().tobytes()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = (name, keys.tobytes(), int(pos), int(has_gauss), float(cached))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    out["python_random"] = random.getstate()
    return out


def rng_digest() -> str:
    return hashlib.sha256(repr(sorted(rng_states().items())).encode()).hexdigest()[:16]


def changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the generators whose state differs (or that appeared / disappeared)."""
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
