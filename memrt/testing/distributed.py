"""Run a function in N real processes over gloo, or a script under ``mpiexec -n N``.

``run_processes`` rendezvous through a TCPStore that the parent opens on port 0 (so concurrent test
runs never collide on a port); each child gets an initialized gloo process group before ``fn`` runs.
Children are always reaped: on timeout or a child's failure the rest are killed and the error says
which rank failed and how.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from memrt.config import environ

__all__ = ["ProcessFailure", "run_processes", "run_mpi", "venv_bin"]


class ProcessFailure(RuntimeError):
    """A child process failed, timed out or died; the message names the rank(s)."""


def _child(fn, rank, world_size, port, env, args, queue, init_pg, pg_timeout_s):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_pg:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=pg_timeout_s))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        if init_pg and dist.is_initialized():
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        sys.exit(1)


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    init_process_group: bool = True,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level). ``env`` is added to each child's environment before
    anything is imported there. Raises :class:`ProcessFailure` naming the failing rank(s).
    """
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    queue = ctx.Queue()
    env = dict(env or {})
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, store.port, env, args, queue,
                                              init_process_group, pg_timeout_s), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise ProcessFailure(f"rank(s) {missing} did not finish within {timeout:.0f}s"
                                     + _describe(errors))
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"exited with code {procs[r].exitcode} without reporting"
                continue
            (results if status == "ok" else errors)[rank] = payload
        if errors:
            raise ProcessFailure(_describe(errors))
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return [results[r] for r in range(world_size)]


def _describe(errors: Mapping[int, str]) -> str:
    return "".join(f"\n--- rank {r} failed: {msg}" for r, msg in sorted(errors.items()))


def venv_bin(name: str) -> str | None:
    """Path of an executable next to this Python (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def run_mpi(
    argv: Sequence[str],
    n: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n <argv>`` (argv[0] 'python' means this interpreter); raise on timeout.

    Returns the completed process (stdout/stderr captured as text); the caller checks returncode.
    """
    mpiexec = venv_bin("mpiexec")
    if mpiexec is None:
        raise FileNotFoundError("mpiexec not found: pip install mpich (or install a system MPI)")
    argv = [sys.executable if a == "python" else a for a in argv]
    full_env = environ()
    full_env.update(env or {})
    try:
        return subprocess.run([mpiexec, "-n", str(n), *argv], env=full_env, cwd=cwd, text=True,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ProcessFailure(f"mpiexec -n {n} {' '.join(argv)} did not finish within {timeout:.0f}s:\n"
                             f"{exc.stdout}\n{exc.stderr}") from exc
