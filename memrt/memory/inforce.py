"""The plan in force on a model under :func:`memrt.auto`, and the plans cached per key.

A key is (structure, input signature, dtype, device, budget, offload) (:func:`memrt.memory.cache.cache_key`);
once input shapes vary the signature is a shape bucket's bound (:mod:`memrt.memory.buckets`). :class:`PlanInForce`
keeps the key and cache entry of the plan the model runs with, puts a plan in force (cached, applied, recorded)
and remembers the profiles of exact shapes made before the shapes varied (``seeds``), which then serve their
buckets.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from memrt.memory.buckets import Shape, widen
from memrt.memory.cache import CacheEntry, PlanCache

if TYPE_CHECKING:
    from memrt.memory.apply import ApplyHandle
    from memrt.memory.planner import Plan
    from memrt.memory.profile import Profile

__all__ = ["PlanInForce", "record_plan"]

logger = logging.getLogger("memrt.memory.auto")  # memrt.auto's messages keep their logger


class PlanInForce:
    """The key and cache entry of the plan a model runs with; the cache of plans per key."""

    def __init__(self, cache: PlanCache, handle: ApplyHandle) -> None:
        self.cache = cache
        self.handle = handle
        """The applied plan's hooks on the model: what :meth:`use` puts the plan into."""
        self.key: str | None = None
        self.signature = ""
        """The signature the plan in force is keyed by (the bucket's bound once shapes vary)."""
        self.entry: CacheEntry | None = None
        self.last_key: str | None = None
        """The key of the last training step."""
        self.seeds: dict[str, tuple[Profile, list[Shape]]] = {}
        """Profiles of exact shapes made before the shapes varied, by their bucket's signature."""

    @property
    def plan(self) -> Plan | None:
        return self.entry.plan if self.entry is not None else None

    def switch(self, key: str, signature: str) -> CacheEntry | None:
        """Make ``key`` (of ``signature``) the key in force; its cached entry, put in force, or None."""
        found = self.cache.get(key)
        self.key, self.signature = key, signature
        self.entry = found
        if found is not None:
            self.handle.set_plan(found.plan)
        return found

    def put(self, entry: CacheEntry) -> None:
        """Cache ``entry`` under the key in force and put its plan in force."""
        self.cache.put(self.key, entry)
        self.entry = entry
        self.handle.set_plan(entry.plan)

    def use(self, p: Plan, profile: Profile, *, tries: int, scale: float) -> None:
        """Put a new plan made from ``profile`` in force for the key in force (its ``tries``-th)."""
        p.tries = tries
        p.shape_scale = scale
        p.signature = self.signature
        self.entry = CacheEntry(plan=p, profile=profile)
        self.cache.put(self.key, self.entry)
        self.handle.set_plan(p)
        record_plan(p)
        logger.info("memrt plan (try %d):\n%s", tries, p)

    def drop(self) -> None:
        """No plan in force (the step runs as without memrt until the next key)."""
        self.key, self.entry = None, None
        self.handle.set_plan(None)

    def keep(self, key: str | None, entry: CacheEntry, shapes: list[Shape]) -> None:
        """Put ``entry`` back in force under ``key``, certified for ``shapes``."""
        self.key, self.entry = key, entry
        self.accept(key, entry, shapes)
        self.handle.set_plan(entry.plan)
        record_plan(entry.plan)

    def accept(self, key: str | None, entry: CacheEntry, shapes: list[Shape]) -> None:
        """The step under ``entry``'s plan is certified: its shapes are covered, the plan is cached."""
        entry.measured_shapes = widen(shapes, entry.measured_shapes)
        self.cache.put(key, entry)

    def back_to_last(self) -> None:
        """No plan in force but the last training step's, where there was one."""
        self.key, self.entry = None, None
        previous = self.cache.get(self.last_key) if self.last_key is not None else None
        if previous is not None:
            self.key, self.entry = self.last_key, previous
            self.handle.set_plan(previous.plan)


def record_plan(p: Plan) -> None:
    """Give ``p`` to the process's recorder (for ``memrt report``); never raises."""
    try:
        from memrt.profiling.recorder import get_recorder

        get_recorder().add_plan(p.to_dict())
    except Exception as exc:  # noqa: BLE001 - reporting must never break training
        logger.debug("could not record plan: %s", exc)
