"""Plan cache: (model structure, input shapes/dtypes, parameter dtype, device, budget) -> plan and profile.

Always in memory for the process, bounded: at most ``max_entries`` plans, the least recently used
dropped first (a job whose input shapes vary makes one plan per shape bucket); also on disk when a
directory is given (a rerun of the job then skips profiling: its first step runs the cached plan and
is measured to certify it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memrt.memory.planner import Plan
from memrt.memory.profile import Profile

__all__ = ["CacheEntry", "PlanCache", "cache_key", "default_cache"]

logger = logging.getLogger(__name__)


def cache_key(structure: str, signature: str, dtype: str, device: str, budget_bytes: int | None,
              options: str = "") -> str:
    raw = f"{structure}|{signature}|{dtype}|{device}|{budget_bytes}|{options}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass(kw_only=True, slots=True)
class CacheEntry:
    plan: Plan
    profile: Profile
    """The profile the plan was made from (at the profiled shape; the plan may be for a larger one)."""
    measured_shapes: Any = None
    """The largest input shapes (elementwise) of the steps measured under this plan, None before the first;
    kept in memory only."""


MAX_ENTRIES = 64
"""Plans kept in memory by default."""


class PlanCache:
    """Plans by key; ``max_entries`` bounds the in-memory entries (least recently used dropped first)."""

    def __init__(self, directory: str | os.PathLike | None = None, *, max_entries: int = MAX_ENTRIES) -> None:
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"PlanCache max_entries must be a positive int, got {max_entries!r}")
        self.directory = Path(directory) if directory is not None else None
        self.max_entries = max_entries
        self._mem: OrderedDict[str, CacheEntry] = OrderedDict()

    def get(self, key: str) -> CacheEntry | None:
        e = self._mem.get(key)
        if e is not None:
            self._mem.move_to_end(key)
            return e
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        try:
            d = json.loads(path.read_text())
            e = CacheEntry(plan=Plan.from_json(d["plan"]), profile=Profile.from_json(d["profile"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable cached plan %s: %s", path, exc)
            return None
        self._remember(key, e)
        return e

    def _remember(self, key: str, entry: CacheEntry) -> None:
        self._mem[key] = entry
        self._mem.move_to_end(key)
        while len(self._mem) > self.max_entries:
            self._mem.popitem(last=False)

    def put(self, key: str, entry: CacheEntry) -> None:
        """Keep ``entry`` (on disk too when the cache has a folder, unless its profile measured nothing)."""
        self._remember(key, entry)
        if self.directory is None or entry.profile.unprofiled:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"{key}.json"
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"plan": json.loads(entry.plan.to_json()),
                                       "profile": json.loads(entry.profile.to_json())}))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not write plan cache %s: %s", self.directory, exc)

    def clear(self) -> None:
        self._mem.clear()

    def __len__(self) -> int:
        return len(self._mem)


_DEFAULT = PlanCache()


def default_cache() -> PlanCache:
    """The process-wide in-memory cache ``memrt.auto`` uses when no ``cache_dir`` is given."""
    return _DEFAULT
