"""Emulate a slow rank: cap one process's CPU share with a cgroup CPU quota (root only).

``cap_process(pid, cpus=0.5)`` moves ``pid`` (all its threads) into a fresh cgroup whose quota lets it
run ``cpus`` CPUs' worth of time per period: ``cpu.max = "<quota> <period>"`` on cgroup v2, or
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` on a cgroup v1 ``cpu`` hierarchy (kernel docs,
Documentation/scheduler/sched-bwc.rst). The returned :class:`CpuCap` puts the process back where it
was and removes the cgroup on ``close()`` (also as a context manager); cgroups left behind by killed
runs are removed by the next cap (:func:`remove_stale_caps`).

:func:`can_cap` says why capping is impossible (not root, no writable cgroup2 with the ``cpu``
controller and no cgroup v1 ``cpu`` hierarchy); tests skip on its reason.

``cap_process(..., threads="compute")`` caps only the process's main thread (its compute, in a
single-threaded rank) and leaves every other thread (gloo's or NCCL's communication threads, memrt's
workers) uncapped, as a slow accelerator slows its compute, not its network: the main thread alone goes to
the capped cgroup, the rest to an uncapped sibling with the same weight, and a small watcher process moves
threads the main thread starts later (they are born in its cgroup) to the sibling; it exits with the
process. Implemented on a cgroup v1 ``cpu`` hierarchy only (cgroup v2 would need a threaded subtree).
Approximate: everything but the main thread runs free, so intra-op threads (``torch.set_num_threads`` above 1)
and child processes (DataLoader workers) escape the cap, and Python code on the free threads (completion
callbacks) waits whenever the quota pauses the main thread while it holds the GIL.

A rank can cap itself from the internal setting ``MEMRT_CPU_CAP`` (``"1=0.5,3=0.25"``: rank -> CPUs;
``"0=max@4,1=0.5@4"``: no quota / 0.5 CPU, both at 4x the default CPU weight; ``"1=0.5@4:compute"``: the
main thread only), see :func:`cap_from_setting`; memrt's tests and benchmarks pass it to their children.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from memrt.config import internal_setting

__all__ = ["CpuCap", "can_cap", "can_cap_threads", "cap_process", "cap_from_setting", "parse_cap_setting", "remove_stale_caps",
           "CAP_THREADS"]

logger = logging.getLogger(__name__)

_PREFIX = "memrt-cpucap-"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_MOUNTS = Path("/proc/mounts")
_FREE_SUFFIX = "-free"
CAP_THREADS = ("all", "compute")
"""What a cap slows: every thread of the process, or its main (compute) thread only."""

# The watcher of a compute-only cap (a detached process in the cgroup of whoever set the cap up, outside both
# of the cap's cgroups): threads the capped main thread starts are born in its cgroup; every one but the main
# thread moves to the uncapped sibling. Polls often while a job starts its threads, then rarely; exits when the
# process is gone (checked by its start time, so a reused pid does not keep it alive) or the cap was lifted.
_WATCHER = """
import os, sys, time
pid, start, capped, free = sys.argv[1:5]
if os.fork():
    os._exit(0)
os.setsid()
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError):
        return False
began = time.monotonic()
while alive():
    try:
        with open(capped + "/tasks") as f:
            tids = f.read().split()
    except OSError:
        break
    for tid in tids:
        if tid != pid:
            try:
                with open(free + "/tasks", "w") as f:
                    f.write(tid)
            except OSError:
                pass
    time.sleep(0.01 if time.monotonic() - began < 60 else 0.1)
"""


def _start_time(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat``: when the process started (clock ticks since boot)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@dataclass(kw_only=True, slots=True, frozen=True)
class _Hierarchy:
    root: Path
    """Mount point of the hierarchy that holds the ``cpu`` controller."""
    version: int
    """2 (unified, ``cpu.max``) or 1 (``cpu.cfs_quota_us``)."""


def _mounts() -> list[tuple[str, str, str]]:
    try:
        text = _PROC_MOUNTS.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1], parts[2], parts[3]))  # mount point, fs type, options
    return out


def _find_hierarchy() -> tuple[_Hierarchy | None, str]:
    """Prefer cgroup v2 at /sys/fs/cgroup (cpu controller, writable); fall back to a v1 cpu mount."""
    if os.geteuid() != 0:
        return None, "needs root (cgroup cpu quota)"
    mounts = _mounts()
    reasons = []
    for point, fstype, _opts in mounts:
        if fstype == "cgroup2" and Path(point) == _CGROUP_ROOT:
            controllers = (Path(point) / "cgroup.controllers").read_text().split()
            if "cpu" not in controllers:
                reasons.append(f"cgroup2 at {point} has no cpu controller (controllers: {controllers})")
            elif not os.access(point, os.W_OK):
                reasons.append(f"cgroup2 at {point} is not writable")
            else:
                return _Hierarchy(root=Path(point), version=2), ""
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and "cpu" in opts.split(","):
            if os.access(point, os.W_OK):
                return _Hierarchy(root=Path(point), version=1), ""
            reasons.append(f"cgroup v1 cpu hierarchy {point} is not writable")
    return None, "; ".join(reasons) or "no cgroup2 with a cpu controller and no cgroup v1 cpu hierarchy mounted"


def can_cap() -> tuple[bool, str]:
    """(True, "") when this process can cap CPU shares, else (False, why not)."""
    hierarchy, why = _find_hierarchy()
    return hierarchy is not None, why


def can_cap_threads() -> tuple[bool, str]:
    """(True, "") when this process can cap a process's main thread alone (``threads="compute"``), else why not."""
    hierarchy, why = _find_hierarchy()
    if hierarchy is None:
        return False, why
    if hierarchy.version != 1:
        return False, (f"capping a main thread alone is implemented on a cgroup v1 cpu hierarchy only; this machine "
                       f"has cgroup v2 at {hierarchy.root}")
    return True, ""


def _cgroup_of(pid: int, hierarchy: _Hierarchy) -> Path:
    """The cgroup directory ``pid`` is in now, within ``hierarchy``."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        ctl = controllers.split(",")
        if (hierarchy.version == 2 and hid == "0") or (hierarchy.version == 1 and "cpu" in ctl):
            return hierarchy.root / path.lstrip("/")
    return hierarchy.root


def remove_stale_caps() -> int:
    """Remove empty memrt cap cgroups whose process (named in the cgroup) has died; returns how many."""
    hierarchy, _ = _find_hierarchy()
    if hierarchy is None:
        return 0
    removed = 0
    for d in hierarchy.root.glob(_PREFIX + "*"):
        pid = d.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue  # its process lives: a cap being set up or in use (another rank's, maybe)
        try:
            if not (d / "cgroup.procs").read_text().strip():
                d.rmdir()
                removed += 1
        except OSError:
            continue
    return removed


class CpuCap:
    """A live cap: ``pid`` runs at most ``cpus`` CPUs. ``close()`` lifts it and removes the cgroup."""

    def __init__(self, pid: int, cpus: float | None, period_us: int, hierarchy: _Hierarchy,
                 priority: float = 1.0, threads: str = "all") -> None:
        self.pid = pid
        self.cpus = cpus
        self.period_us = period_us
        self.priority = priority
        self.hierarchy = hierarchy
        self.threads = threads
        self.origin = _cgroup_of(pid, hierarchy)
        self.path = hierarchy.root / f"{_PREFIX}{pid}-{uuid.uuid4().hex[:6]}"
        self.free: Path | None = None
        """The uncapped sibling of a compute-only cap (every thread but the main one)."""
        self._closed = False
        quota_us = None if cpus is None else max(1000, int(round(cpus * period_us)))  # kernel minimum: 1 ms
        if hierarchy.version == 2:
            self._enable_cpu_controller()
        self.path.mkdir()
        try:
            if hierarchy.version == 2:
                (self.path / "cpu.max").write_text(f"{'max' if quota_us is None else quota_us} {period_us}")
                if priority != 1.0:  # cpu.weight: default 100, range 1..10000
                    (self.path / "cpu.weight").write_text(str(max(1, min(10000, round(100 * priority)))))
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(-1 if quota_us is None else quota_us))
                if priority != 1.0:  # cpu.shares: default 1024, range 2..262144
                    (self.path / "cpu.shares").write_text(str(max(2, min(262144, round(1024 * priority)))))
            if threads == "compute":
                self._cap_main_thread()
            else:
                (self.path / "cgroup.procs").write_text(str(pid))
        except BaseException:
            self._release(quiet=True)
            raise
        logger.info("capped pid %d at %s CPU (quota %s us per %d us, priority %.1fx, cgroup v%d)", pid,
                    "no" if cpus is None else f"{cpus:.2f}", quota_us, period_us, priority, hierarchy.version)

    def _cap_main_thread(self) -> None:
        """The uncapped sibling and the watcher first (the watcher stays in the caller's cgroup), then the whole
        process into the sibling and its main thread alone into the capped cgroup."""
        self.free = Path(str(self.path) + _FREE_SUFFIX)
        self.free.mkdir()
        (self.free / "cpu.shares").write_text((self.path / "cpu.shares").read_text())
        # -I -S: no site-packages, so no .pth file (memrt's activation among them) runs in the watcher; it detaches
        # (the intermediate exits at once and is reaped here) and holds none of the job's pipes
        subprocess.run([sys.executable, "-I", "-S", "-c", _WATCHER, str(self.pid), _start_time(self.pid),
                        str(self.path), str(self.free)], check=True, timeout=30, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (self.free / "cgroup.procs").write_text(str(self.pid))
        (self.path / "tasks").write_text(str(self.pid))

    def _enable_cpu_controller(self) -> None:
        control = self.hierarchy.root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")

    def close(self) -> None:
        """Move every process of the cap back to where ``pid`` was, then remove the cgroup(s)."""
        if self._closed:
            return
        self._closed = True
        self._release(quiet=False)

    def _move_back(self, d: Path) -> None:
        try:
            pids = (d / "cgroup.procs").read_text().split()
        except OSError:
            return
        for p in pids:
            for target in (self.origin, self.hierarchy.root):
                try:
                    (target / "cgroup.procs").write_text(p)
                    break
                except OSError:  # origin gone or not a leaf: fall back to the root
                    continue

    def _release(self, *, quiet: bool) -> None:
        """Processes back to the origin, the capped cgroup removed (its watcher then exits), then the sibling:
        retried for a moment, since the watcher may move a thread it listed just before the drain."""
        for d in (self.path, self.free):
            if d is not None:
                self._move_back(d)
        for d, tries in ((self.path, 1), (self.free, 30)):
            if d is None:
                continue
            for attempt in range(tries):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if attempt + 1 < tries:
                        time.sleep(0.01)
                        self._move_back(d)
                    elif not quiet:
                        logger.warning("could not remove cgroup %s: %s (remove_stale_caps() retries)", d, exc)

    def __enter__(self) -> "CpuCap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass


def cap_process(pid: int | None = None, cpus: float | None = 0.5, *, period_us: int = 20_000,
                priority: float = 1.0, threads: str = "all") -> CpuCap:
    """Cap ``pid`` (default: this process) at ``cpus`` CPUs (0.5 = half of one CPU; None = no quota).

    ``period_us`` is the quota period (1000..1_000_000 us); a short period spreads the throttling
    evenly over a training step. ``priority`` multiplies the cgroup's CPU weight (1.0 = like any other
    process): on a machine shared with other work, giving every rank of an emulated cluster the same
    higher priority keeps an uncapped rank near a full CPU, so the cap alone sets the speed ratio.
    ``threads="compute"`` caps the main thread only (see the module docstring; cgroup v1).
    Raises ``PermissionError`` with the reason when capping is impossible.
    """
    if cpus is not None and not 0.01 <= cpus <= 1024:
        raise ValueError(f"cpus={cpus!r} is not valid: expected a CPU count between 0.01 and 1024, or None")
    if not 0.01 <= priority <= 100:
        raise ValueError(f"priority={priority!r} is not valid: expected a weight multiplier between 0.01 and 100")
    if not 1000 <= period_us <= 1_000_000:
        raise ValueError(f"period_us={period_us!r} is not valid: expected 1000..1000000 microseconds")
    if threads not in CAP_THREADS:
        raise ValueError(f"threads={threads!r} is not valid: expected one of {CAP_THREADS}")
    hierarchy, why = _find_hierarchy()
    if hierarchy is None:
        raise PermissionError(f"cannot cap CPU share: {why}")
    if threads == "compute":
        ok, why = can_cap_threads()
        if not ok:
            raise PermissionError(f"cannot cap the compute thread alone: {why}")
    remove_stale_caps()
    return CpuCap(os.getpid() if pid is None else pid, cpus, period_us, hierarchy, priority, threads)


def parse_cap_setting(raw: str | None) -> dict[int, tuple[float | None, float, str]]:
    """``"1=0.5,3=0.25@4,0=max@4:compute"`` -> {rank: (cpus or None, priority, threads)}; empty or None -> {}."""
    out: dict[int, tuple[float | None, float, str]] = {}
    if not raw or not raw.strip():
        return out
    for item in raw.split(","):
        rank, sep, value = item.partition("=")
        value, colon, threads = value.partition(":")
        threads = threads.strip()
        cpus, _, prio = value.partition("@")
        try:
            if not sep or (colon and threads not in CAP_THREADS):
                raise ValueError
            out[int(rank)] = (None if cpus.strip() == "max" else float(cpus), float(prio) if prio else 1.0,
                              threads or "all")
        except ValueError:
            raise ValueError(f"MEMRT_CPU_CAP={raw!r} is not valid: expected rank=cpus[@priority][:compute] pairs "
                             "like 1=0.5,3=0.25 or 0=max@4,1=0.5@4:compute") from None
    return out


def cap_from_setting(rank: int, *, period_us: int = 20_000) -> CpuCap | None:
    """Cap this process if ``MEMRT_CPU_CAP`` names ``rank``; None when it does not."""
    caps = parse_cap_setting(internal_setting("MEMRT_CPU_CAP"))
    if rank not in caps:
        return None
    cpus, priority, threads = caps[rank]
    return cap_process(None, cpus, period_us=period_us, priority=priority, threads=threads)
