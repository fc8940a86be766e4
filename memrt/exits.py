"""Ending a process at once: ``os._exit`` after the clean-ups that must still run.

``os._exit`` skips atexit (a thread blocked on a dead peer would otherwise hold the process forever), so a
part of memrt that leaves files behind registers their removal here (:func:`on_hard_exit`) and a part that
must end the process calls :func:`hard_exit`. Neither needs to import the other: the offload tiers register,
memrt.comm's health watchdog exits.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, NoReturn

__all__ = ["hard_exit", "on_hard_exit"]

logger = logging.getLogger(__name__)

_CLEANUPS: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def on_hard_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` before :func:`hard_exit` ends this process (once per function, in registration order)."""
    with _LOCK:
        if cleanup not in _CLEANUPS:
            _CLEANUPS.append(cleanup)


def hard_exit(code: int) -> NoReturn:
    """Run the registered clean-ups (a failing one is skipped: exiting matters more), then ``os._exit(code)``."""
    with _LOCK:
        cleanups = list(_CLEANUPS)
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the next start on this host sweeps what is left
            logger.debug("clean-up before exit failed", exc_info=True)
    os._exit(code)
