"""Python's garbage collector in an activated job: what is alive after the first backward is frozen.

A training process holds a few hundred thousand Python objects that live as long as it does: torch's modules,
the tables dynamo builds when DDP imports it, the model, the optimizer, the data. Python's full collections scan
every one of them (about 100 ms for 290,000 objects on a 2-core CPU machine), at moments set by each rank's own
allocations; in a multi-rank job a rank inside one holds every other rank at the next collective. After the first
``backward`` returns, memrt collects once and moves every live object to the collector's permanent generation
(:func:`gc.freeze`): later collections scan only the objects made since, and stay short. Objects are still freed
by reference counting; a frozen object that later becomes part of unreachable reference cycle is never
collected, so what is frozen is the job's set-up, which lives as long as the job.

``MEMRT_GC_FREEZE=off`` leaves the collector alone; so does a job that turned the collector off itself
(``gc.disable()``: it collects on its own schedule).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

__all__ = ["freeze_after_first_backward"]

logger = logging.getLogger("memrt.activation")


def freeze_after_first_backward(sess: Any) -> None:
    """Collect and freeze once per process, at the end of the first backward of a session that allows it;
    what was frozen goes to ``sess.gc_frozen`` (the report)."""
    if sess.gc_frozen is not None or not sess.config.gc_freeze:
        return
    if not gc.isenabled():
        sess.gc_frozen = {"objects": 0, "seconds": 0.0, "skipped": "the job turned the collector off"}
        return
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    seconds = time.perf_counter() - start
    sess.gc_frozen = {"objects": gc.get_freeze_count(), "seconds": round(seconds, 4)}
    logger.info("memrt: froze %d objects alive after the first backward (collected in %.0f ms)",
                sess.gc_frozen["objects"], seconds * 1e3)
