"""Python's garbage collector in an activated job: the job's set-up frozen before its first training step.

A training process holds a few hundred thousand Python objects that live as long as it does: torch's modules,
the tables dynamo builds when DDP imports it, the model, the data. Python's full collections scan every one of
them (about 100 ms for the ~290,000 objects of a DDP job on a 2-core CPU machine), at moments set by each rank's
own allocations; in a multi-rank job a rank inside one holds every other rank at the next collective. Once the
set-up is built (the first ``DistributedDataParallel(...)`` or FSDP2 ``fully_shard(...)`` has returned: the
model exists, and DDP has imported dynamo), memrt collects once and moves every live object to the collector's
permanent generation (:func:`gc.freeze`): later collections scan only the objects made since, and stay short.

Frozen objects are still freed by reference counting; one that later becomes part of an unreachable reference
cycle is never collected. No training step has begun at the freeze (no autograd graph, no batch through the
model), so what is frozen is what the job built to train with.

``MEMRT_GC_FREEZE=off`` leaves the collector alone; so does a job that turned the collector off itself
(``gc.disable()``: it collects on its own schedule).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

__all__ = ["freeze_setup"]

logger = logging.getLogger("memrt.activation")


def freeze_setup(sess: Any) -> None:
    """Collect and freeze once per session; what was frozen, or why nothing was, goes to ``sess.gc_frozen``
    (the report). Never raises: a failure is reported and the collector left as it was."""
    if sess.gc_frozen is not None:
        return
    skipped = None
    if not sess.config.gc_freeze:
        skipped = "MEMRT_GC_FREEZE=off"
    elif not gc.isenabled():
        skipped = "the job turned the collector off (gc.disable())"
    if skipped is not None:
        sess.gc_frozen = {"objects": 0, "seconds": 0.0, "skipped": skipped}
        return
    start = time.perf_counter()
    try:
        gc.collect()
        gc.freeze()
    except Exception as exc:  # noqa: BLE001 - an optimisation: the job goes on without it
        sess.gc_frozen = {"objects": 0, "seconds": 0.0, "skipped": f"{type(exc).__name__}: {exc}"}
        logger.warning("memrt: freezing the job's set-up for Python's garbage collector failed (%s: %s); "
                       "the collector is left as it was", type(exc).__name__, exc)
        return
    seconds = time.perf_counter() - start
    sess.gc_frozen = {"objects": gc.get_freeze_count(), "seconds": round(seconds, 4)}
    logger.info("memrt: froze the %d objects of the job's set-up (collected in %.0f ms)",
                sess.gc_frozen["objects"], seconds * 1e3)
