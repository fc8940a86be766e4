"""No hangs: peer-death detection and a cheap cross-rank check of collective arguments.

Liveness: every rank's :class:`HealthMonitor` thread bumps a counter ``memrt/hb/<rank>`` in the
rendezvous store once per ``interval_s``. When a collective fails (gloo reports a closed connection
when a peer dies), :meth:`HealthMonitor.diagnose` waits ``stale_s`` and names the ranks whose counter
stopped without them reporting a failure of their own: the error says "rank 2 is gone". When a
collective does not fail but stops progressing (a peer is frozen or its host vanished), the watchdog
in the same thread notices a stale peer while this rank has had a collective in flight for longer than
``hang_s``, prints the diagnosis and ends the process with exit code 1 (like NCCL's async error handling).
"In flight" covers every collective memrt runs: a blocking call (:meth:`HealthMonitor.inside`) and an
async one from its launch to its completion (:meth:`HealthMonitor.begin` / :meth:`~HealthMonitor.end`),
whether its Work is waited on or its future handed on (DDP's comm hook), so both paths are diagnosed.

Mismatch check (on by default in debug mode: ``MEMRT_LOG_LEVEL=debug`` or ``TORCH_DISTRIBUTED_DEBUG``
INFO/DETAIL): before a collective, every rank all-gathers a 12-integer signature (op, dtype, shape)
over a small gloo group and raises :class:`CollectiveMismatchError` listing the ranks that differ.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from memrt.exits import hard_exit

__all__ = ["install_exit_guard", "PeerFailureError", "CollectiveMismatchError", "HealthMonitor", "signature",
           "check_signatures"]

logger = logging.getLogger(__name__)


class PeerFailureError(RuntimeError):
    """A collective failed or stalled because peer rank(s) died; ``missing`` names them."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different ops, dtypes or shapes."""


_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "other")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_SIG_LEN = 12


def signature(op: str, tensor: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """[op, dtype, extra, ndim, shape... (up to 8 dims)] as int64 on the CPU."""
    shape = list(tensor.shape)[:8]
    dt = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
    row = [_OPS.index(op) if op in _OPS else len(_OPS), dt, int(extra), tensor.dim()] + shape
    row += [-1] * (_SIG_LEN - len(row))
    return torch.tensor(row[:_SIG_LEN], dtype=torch.int64)


def _describe(row: list[int]) -> str:
    op = _OPS[row[0]] if row[0] < len(_OPS) else "?"
    dt = str(_DTYPES[row[1]]).replace("torch.", "") if row[1] < len(_DTYPES) else "?"
    shape = [d for d in row[4:4 + row[3]]]
    return f"{op}({dt}, shape={tuple(shape)}, arg={row[2]})"


def check_signatures(op: str, tensor: torch.Tensor, group: Any, *, extra: int = 0) -> None:
    """Collective over ``group`` (a gloo group): raise if any rank's signature differs from rank 0's."""
    import torch.distributed as dist

    mine = signature(op, tensor, extra)
    n = dist.get_world_size(group)
    out = torch.empty(n * _SIG_LEN, dtype=torch.int64)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=group)
    rows = out.view(n, _SIG_LEN).tolist()
    if any(r != rows[0] for r in rows):
        groups: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(_describe(row), []).append(r)
        detail = "; ".join(f"rank(s) {rs}: {d}" for d, rs in groups.items())
        raise CollectiveMismatchError(f"collective arguments differ across ranks: {detail}. Every rank must call "
                                      "the same collective with the same dtype and shape.")


class HealthMonitor:
    """Heartbeats in the rendezvous store, failure diagnosis, and the hang watchdog."""

    def __init__(self, store: Any, rank: int, world_size: int, *, interval_s: float = 1.0, stale_s: float = 6.0,
                 hang_s: float = 20.0, exit_on_hang: bool = True) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.stale_s, self.hang_s = interval_s, stale_s, hang_s
        self.exit_on_hang = exit_on_hang
        self._count = 0
        self._stop = threading.Event()
        self._inside: dict[int, tuple[str, float]] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._tracked: list[tuple[str, float, Any]] = []  # (name, start, CUDA end event) of NCCL calls in flight
        self._thread: threading.Thread | None = None
        self.store_lost = False

    # ---- lifecycle
    def start(self) -> "HealthMonitor":
        self._beat()
        self._thread = threading.Thread(target=self._run, name="memrt-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.set(f"memrt/hb/{self.rank}/left", "1")
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"memrt/hb/{self.rank}", str(self._count))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001
                self.store_lost = True
            self._watchdog()

    def begin(self, name: str) -> int:
        """Mark collective ``name`` as in flight (for the hang watchdog) until :meth:`end` with the token.

        For collectives no thread waits on (an async Work, a future DDP holds): the span runs from the
        launch to the completion of the work, whoever waits for it.
        """
        token = next(self._tokens)
        with self._lock:
            self._inside[-token] = (name, time.monotonic())
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._inside.pop(-token, None)

    @contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """Mark this thread as inside collective ``name`` (for the hang watchdog)."""
        token = self.begin(name)
        try:
            yield
        finally:
            self.end(token)

    def track(self, name: str, event: Any) -> None:
        """Watch collective ``name`` until ``event`` (a CUDA event after its work) completes: on NCCL the call
        returns at enqueue, so a hang shows up here, not inside :meth:`inside`."""
        with self._lock:
            self._tracked = [(n, t, e) for n, t, e in self._tracked if not e.query()]
            self._tracked.append((name, time.monotonic(), event))

    # ---- diagnosis
    def _read(self, r: int) -> bytes | None:
        key = f"memrt/hb/{r}"
        if not self.store.check([key]):
            return None
        return self.store.get(key)

    def stale_peers(self) -> list[int]:
        """Peers whose counter has not moved for ``stale_s`` (dead, or exited after marking a failure)."""
        now = time.monotonic()
        stale = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            value = self._read(r)
            old = self._seen.get(r)
            if old is None or old[0] != value:
                self._seen[r] = (value, now)
            elif now - old[1] >= self.stale_s:
                stale.append(r)
        return stale

    def split_stale(self, stale: list[int]) -> tuple[list[int], list[int]]:
        """(missing: died without a word, failed: exited after reporting a failure of their own)."""
        failed = [r for r in stale if self._marked(r)]
        return [r for r in stale if r not in failed], failed

    def _marked(self, r: int) -> bool:
        return bool(self.store.check([f"memrt/hb/{r}/failed"]) or self.store.check([f"memrt/hb/{r}/left"]))

    def mark_failed(self, reason: str) -> None:
        try:
            self.store.set(f"memrt/hb/{self.rank}/failed", reason[:200])
        except Exception:  # noqa: BLE001
            pass

    def missing_ranks(self, within_s: float | None = None) -> list[int] | None:
        """Ranks that stopped beating without reporting a failure (polls up to ``within_s``).

        None when the store itself is unreachable.
        """
        within_s = self.stale_s + 3 * self.interval_s if within_s is None else within_s
        deadline = time.monotonic() + within_s
        try:
            while True:
                missing, _ = self.split_stale(self.stale_peers())
                if missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(min(self.interval_s / 2, 0.5))
        except Exception:  # noqa: BLE001 - store unreachable
            return None

    def _linger(self, missing: list[int], within_s: float = 15.0) -> None:
        """Keep this process (maybe the store's host) up until every live peer has finished its diagnosis."""
        self.store.set(f"memrt/hb/{self.rank}/diagnosed", "1")
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                stale = set(self.stale_peers())
                pending = [r for r in range(self.world_size) if r != self.rank and r not in missing
                           and r not in stale and not self.store.check([f"memrt/hb/{r}/diagnosed"])]
            except Exception:  # noqa: BLE001
                return
            if not pending:
                return
            time.sleep(0.2)

    def diagnose(self, op: str, exc: BaseException) -> PeerFailureError:
        """The error to raise after ``op`` failed with ``exc``: names the missing rank(s) when found."""
        self.mark_failed(f"{op}: {type(exc).__name__}")
        missing = self.missing_ranks()
        if missing is None:
            msg = (f"memrt.comm: {op} failed on rank {self.rank} and the rendezvous store is unreachable: the process "
                   f"hosting it (rank 0 under env:// or tcp:// init, or the launcher) is gone ({exc})")
            return PeerFailureError(msg, (0,))
        if missing:
            self.mark_failed(f"{op}: rank(s) {missing} are gone")
        try:
            self._linger(missing)
        except Exception:  # noqa: BLE001
            pass
        install_exit_guard()
        if missing:
            msg = (f"memrt.comm: {op} failed on rank {self.rank}: rank(s) {missing} are gone (no heartbeat for "
                   f"{self.stale_s:.0f} s); the job cannot continue ({type(exc).__name__}: {_first_line(exc)})")
            # said here too: DDP and other holders of a future re-wrap the exception inside their own traceback
            print(msg, file=sys.stderr, flush=True)
        else:
            msg = (f"memrt.comm: {op} failed on rank {self.rank}; every peer is still alive "
                   f"({type(exc).__name__}: {_first_line(exc)})")
        return PeerFailureError(msg, missing)

    def _peer_reports(self) -> list[tuple[int, str]]:
        out = []
        for r in range(self.world_size):
            key = f"memrt/hb/{r}/failed"
            if r != self.rank and self.store.check([key]):
                out.append((r, self.store.get(key).decode(errors="replace")))
        return out

    def _watchdog(self) -> None:
        with self._lock:
            self._tracked = [(n, t, e) for n, t, e in self._tracked if not e.query()]
            inside = list(self._inside.values()) + [(n, t) for n, t, _ in self._tracked]
        if not inside:
            return
        name, since = min(inside, key=lambda x: x[1])
        waited = time.monotonic() - since
        msg = None
        try:
            reports = self._peer_reports() if waited >= 2 * self.interval_s else []
            named = [(r, why) for r, why in reports if "are gone" in why]
            if named:
                r, why = named[0]
                msg = f"memrt.comm: rank {self.rank} stuck in {name}: {why.split(': ', 1)[-1]} (reported by rank {r})"
            stale = self.stale_peers()
        except Exception:  # noqa: BLE001
            stale, self.store_lost = None, True
        if msg is None and waited < self.hang_s:
            return
        if msg is not None:
            pass
        elif stale is None:
            msg = (f"memrt.comm: rank {self.rank} stuck in {name} for {self.hang_s:.0f} s and the rendezvous store is "
                   "unreachable: the process hosting it (rank 0 or the launcher) is gone")
        elif stale:
            missing, failed = self.split_stale(stale)
            silent = max(time.monotonic() - self._seen[r][1] for r in stale)
            msg = (f"memrt.comm: rank {self.rank} waited {waited:.0f} s in {name}: rank(s) {missing} stopped "
                   f"responding (no heartbeat for {silent:.0f} s: frozen, stopped or gone); exiting" if missing else
                   f"memrt.comm: rank {self.rank} waited {waited:.0f} s in {name}: rank(s) {failed} left after a "
                   "failure; exiting")
        else:
            return
        print(msg, file=sys.stderr, flush=True)
        if self.exit_on_hang:
            self.mark_failed(f"hang in {name}")
            hard_exit(1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


_guard_installed = False
_diagnosed = False


def install_exit_guard(grace_s: float = 20.0) -> None:
    """After an uncaught PeerFailureError, end the process if interpreter shutdown hangs for ``grace_s``.

    Shutdown joins threads; one blocked on a socket to a dead peer would hold the process forever.
    """
    global _guard_installed, _diagnosed
    _diagnosed = True
    if _guard_installed:
        return
    _guard_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        # a PeerFailureError raised in a future's callback reaches here wrapped (DDP: RuntimeError)
        if isinstance(exc, PeerFailureError) or _diagnosed:
            def guard() -> None:
                time.sleep(grace_s)
                print(f"memrt.comm: shutdown after {exc_type.__name__} hung for {grace_s:.0f} s; exiting",
                      file=sys.stderr, flush=True)
                hard_exit(1)

            threading.Thread(target=guard, name="memrt-exit-guard", daemon=True).start()

    sys.excepthook = hook
