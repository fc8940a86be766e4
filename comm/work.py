"""The Work objects memrt.comm returns for ``async_op=True``, and how a failed collective is reported.

:class:`MemrtWork` wraps memrt's own algorithms (run on the comm thread); :class:`RecordedWork` wraps
torch's Work for a flat call, records the call when it completes and turns a peer's failure into a
:class:`~memrt.comm.health.PeerFailureError` naming the peer.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, NoReturn

import torch

from memrt.comm.setup import STATE

__all__ = ["MemrtWork", "RecordedWork", "raise_diagnosed"]


class MemrtWork:
    """What ``async_op=True`` returns for memrt's algorithms: ``wait()``, ``is_completed()``, ``get_future()``."""

    def __init__(self, fut: cf.Future, tensors: list[torch.Tensor]) -> None:
        self._fut = fut
        self._tensors = tensors
        self._tfut: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        secs = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        self._fut.result(timeout=secs)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self._fut.exception() is None

    def exception(self) -> BaseException | None:
        return self._fut.exception() if self._fut.done() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        """A torch Future whose value is the list of output tensors (as torch's Work.get_future())."""
        if self._tfut is None:
            tfut: torch.futures.Future = torch.futures.Future()

            def done(f: cf.Future) -> None:
                exc = f.exception()
                tfut.set_exception(exc) if exc is not None else tfut.set_result(self._tensors)

            self._fut.add_done_callback(done)
            self._tfut = tfut
        return self._tfut


class RecordedWork:
    """A torch Work that records its CommRecord when it completes, and diagnoses peer failures.

    The health watchdog sees the collective as in flight from its launch to its completion, whether the
    caller waits on it (``wait()``) or hands its future on (``get_future()``, as DDP's comm hook does): a
    frozen peer is reported, and a dead one named, on both paths.
    """

    def __init__(self, work: Any, finish: Callable[[], None], name: str) -> None:
        self._work, self._name = work, name
        self._pending: Callable[[], None] | None = finish
        self._lock = threading.Lock()
        self._chained: Any = None
        health = STATE.health
        self._token = health.begin(name) if health is not None else None
        if self._token is not None:
            try:
                work.get_future().add_done_callback(lambda _f: health.end(self._token))
            except Exception:  # noqa: BLE001 - a Work without a future: wait() ends the span
                pass

    def _end(self) -> None:
        if self._token is not None and STATE.health is not None:
            STATE.health.end(self._token)

    def _finish_once(self) -> None:
        """Record the call once (it may be both waited on and completed through its future)."""
        with self._lock:
            finish, self._pending = self._pending, None
        if finish is not None:
            finish()

    def wait(self, *args: Any, **kw: Any) -> bool:
        try:
            ok = self._work.wait(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            self._end()
            raise_diagnosed(self._name, exc)
        self._end()
        self._finish_once()
        return ok

    def get_future(self) -> Any:
        """The work's future, recorded on completion; a failure becomes the diagnosed PeerFailureError."""
        if self._chained is None:
            def after(fut: Any) -> Any:
                try:
                    value = fut.value()
                except Exception as exc:  # noqa: BLE001
                    raise_diagnosed(self._name, exc)
                self._finish_once()
                return value

            self._chained = self._work.get_future().then(after)
        return self._chained

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def raise_diagnosed(name: str, exc: BaseException) -> NoReturn:
    from memrt.comm.health import CollectiveMismatchError, PeerFailureError

    if STATE.health is None or isinstance(exc, (PeerFailureError, CollectiveMismatchError, TypeError, ValueError)):
        raise exc
    raise STATE.health.diagnose(name, exc) from exc
