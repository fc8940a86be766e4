"""Run ranks as torchrun would, and reap every one: the one launcher of memrt's tests, benchmarks and demo.

:func:`launch_ranks` starts a command once per rank with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT), so ``memrt.comm.init_process_group()``
(or torch's, with env://) works unchanged. :func:`run_processes` runs a Python function on N ranks through
it (each rank joins a gloo group first) and :func:`run_on_cluster` runs a command on an emulated two-node
cluster; :func:`run_mpi` is ``mpiexec -n N``, whose own launcher starts the ranks.

The port rule: on loopback the rendezvous port is the kernel's pick, :func:`memrt.launcher.free_port` (or
the port of the store :func:`run_processes` opens on port 0 and holds for its ranks); on an
:class:`~memrt.cluster.EmulatedCluster` node i's ranks run inside namespace i and talk to node 0's address
through the rate-limited link (fresh namespaces: any port is free there). Output goes to files (no pipe can
fill up); when one rank fails the others are killed (they would wait on it until their timeout), and every
process is reaped on timeout.

    from memrt.cluster import EmulatedCluster
    from memrt.testing.launch import launch_ranks
    with EmulatedCluster("1gbit") as c:
        results = launch_ranks(["python", "bench.py", "--worker"], ranks_per_node=(2, 2), cluster=c)
    print(results[0].stdout)
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from memrt.cluster.emulated import EmulatedCluster
from memrt.config import environ
from memrt.launcher import free_port

__all__ = ["ProcessFailure", "RankResult", "first_failure", "launch_ranks", "run_mpi", "run_on_cluster",
           "run_processes", "venv_bin"]


class ProcessFailure(RuntimeError):
    """A rank failed, timed out or died; the message names the rank(s)."""


@dataclass(kw_only=True, slots=True)
class RankResult:
    """What one rank printed and how it ended."""

    rank: int
    node: int
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    """Killed because the job ran past its timeout (not because it failed)."""
    killed: bool = False
    """Killed because another rank failed first."""


def launch_ranks(argv: Sequence[str], *, ranks_per_node: Sequence[int], cluster: EmulatedCluster | None = None,
                 env: Mapping[str, str] | None = None, rank_env: Callable[[int], Mapping[str, str]] | None = None,
                 timeout_s: float = 600.0, check: bool = True, port: int | None = None) -> list[RankResult]:
    """Start ``argv`` once per rank (``"python"`` = this interpreter) and wait for all; results by rank.

    Ranks are numbered node by node (node 0 holds ranks 0..ranks_per_node[0]-1). Without ``cluster`` every
    rank runs on loopback. ``env`` is added to this process's environment for every rank, ``rank_env(rank)``
    on top. ``check`` raises RuntimeError naming the rank that failed first, with the end of its output.
    ``port``: MASTER_PORT when the caller already holds a store there (:func:`run_processes`); default
    the port rule above.
    """
    per_node = [int(n) for n in ranks_per_node]
    if not per_node or min(per_node) < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} is not valid: expected counts >= 1")
    if cluster is not None and len(per_node) != len(cluster.nodes):
        raise ValueError(f"ranks_per_node={ranks_per_node!r}: the emulated cluster has {len(cluster.nodes)} nodes")
    world = sum(per_node)
    addr = cluster.addrs[0] if cluster is not None else "127.0.0.1"
    if port is None:  # namespaces: a port from OS entropy (the user's `random` stays untouched)
        port = random.SystemRandom().randint(20000, 40000) if cluster is not None else free_port(addr)
    argv = [sys.executable if a == "python" else a for a in argv]
    procs: list[tuple[int, int, subprocess.Popen, Path, Path]] = []
    tmp = tempfile.TemporaryDirectory(prefix="memrt-ranks-")
    timed_out, killed = set(), set()
    try:
        rank = 0
        for node, count in enumerate(per_node):
            for local in range(count):
                full = dict(env or {})
                full.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(count),
                            GROUP_RANK=str(node), NODE_RANK=str(node), MASTER_ADDR=addr, MASTER_PORT=str(port))
                full.update(rank_env(rank) if rank_env else {})
                out, err = Path(tmp.name) / f"{rank}.out", Path(tmp.name) / f"{rank}.err"
                with open(out, "w") as fo, open(err, "w") as fe:
                    if cluster is not None:
                        p = cluster.popen(node, argv, env=full, stdout=fo, stderr=fe)
                    else:
                        p = subprocess.Popen(argv, env={**environ(), **full}, stdout=fo, stderr=fe)
                procs.append((rank, node, p, out, err))
                rank += 1
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for _, _, p, _, _ in procs):
            if any(p.poll() not in (None, 0) for _, _, p, _, _ in procs):  # one failed: stop the rest
                killed = {r for r, _, p, _, _ in procs if p.poll() is None}
                break
            if time.monotonic() > deadline:
                timed_out = {r for r, _, p, _, _ in procs if p.poll() is None}
                break
            time.sleep(0.05)
        for _, _, p, _, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        results = [RankResult(rank=r, node=node, returncode=p.returncode, stdout=out.read_text(errors="replace"),
                              stderr=err.read_text(errors="replace"), timed_out=r in timed_out, killed=r in killed)
                   for r, node, p, out, err in procs]
    finally:
        for _, _, p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        tmp.cleanup()
    if check:
        failed = first_failure(results)
        if failed is not None:
            why = "timed out after %.0f s" % timeout_s if failed.timed_out else f"exited {failed.returncode}"
            raise RuntimeError(f"rank {failed.rank} {why}:\n{failed.stderr[-2000:]}")
    return results


def first_failure(results: Sequence[RankResult]) -> RankResult | None:
    """The rank that failed first (not one killed because it did), or a timed-out one; None when all ended well."""
    bad = [r for r in results if r.returncode != 0 and not r.killed]
    return bad[0] if bad else None


def run_on_cluster(argv: Sequence[str], *, cluster: EmulatedCluster | None = None, rate: str = "1gbit",
                   ranks_per_node: int | Sequence[int] = 2, env: Mapping[str, str] | None = None,
                   timeout_s: float = 600.0, check: bool = True) -> list[RankResult]:
    """:func:`launch_ranks` on two emulated nodes (a fresh cluster at ``rate`` when ``cluster`` is None);
    ``ranks_per_node`` is one count for both nodes or one per node (uneven nodes: ``(3, 1)``)."""
    if cluster is None:
        with EmulatedCluster(rate) as c:
            return run_on_cluster(argv, cluster=c, ranks_per_node=ranks_per_node, env=env, timeout_s=timeout_s,
                                  check=check)
    per_node = [ranks_per_node] * 2 if isinstance(ranks_per_node, int) else list(ranks_per_node)
    return launch_ranks(argv, ranks_per_node=per_node, cluster=cluster, env=env, timeout_s=timeout_s, check=check)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, env: Mapping[str, str] | None = None,
                  timeout: float = 120.0, init_process_group: bool = True, pg_timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks started by :func:`launch_ranks`; results by rank.

    ``fn`` must be importable (module level) and its arguments and result picklable. ``env`` is added to
    each rank's environment before anything is imported there. This process holds the TCPStore at
    MASTER_PORT; with ``init_process_group`` every rank joins a gloo group on it (``pg_timeout_s``) before
    ``fn`` runs and leaves it after. Raises
    :class:`ProcessFailure` naming the rank(s) that failed, with their error and traceback.
    """
    import torch.distributed as dist

    # the store every rank meets at, held here on the kernel's pick of port (so it is free): a function may
    # also open its own client on MASTER_PORT before, or instead of, its process group
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    with tempfile.TemporaryDirectory(prefix="memrt-call-") as tmp:
        call = Path(tmp) / "call.pkl"
        call.write_bytes(pickle.dumps((fn, args, init_process_group, pg_timeout_s)))
        # the ranks import fn's module by name, as this process did: same search path
        paths = [p or os.getcwd() for p in sys.path]
        full = {**(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
        results = launch_ranks(["python", "-m", "memrt.testing.rank_call", tmp], ranks_per_node=[world_size],
                               env=full, timeout_s=timeout, check=False, port=store.port)
        outcomes = {}
        for r in range(world_size):
            path = Path(tmp) / f"result-{r}.pkl"
            if path.exists():
                outcomes[r] = pickle.loads(path.read_bytes())
        errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
        for res in results:
            if res.rank in outcomes or res.killed:
                continue
            if res.timed_out:
                errors[res.rank] = f"did not finish within {timeout:.0f}s\n{res.stderr[-2000:]}"
            else:
                errors[res.rank] = f"exited with code {res.returncode} without reporting\n{res.stderr[-2000:]}"
        if errors:
            raise ProcessFailure("".join(f"\n--- rank {r} failed: {msg}" for r, msg in sorted(errors.items())))
        missing = [r for r in range(world_size) if r not in outcomes]
        if missing:  # killed while another rank failed without reporting: cannot happen unless a rank vanished
            raise ProcessFailure(f"rank(s) {missing} ended without a result")
        return [outcomes[r][1] for r in range(world_size)]


def venv_bin(name: str) -> str | None:
    """Path of an executable next to this Python (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def run_mpi(argv: Sequence[str], n: int, *, env: Mapping[str, str] | None = None, timeout: float = 120.0,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n <argv>`` (argv[0] 'python' means this interpreter); raise on timeout.

    Returns the completed process (stdout/stderr captured as text); the caller checks returncode.
    """
    mpiexec = venv_bin("mpiexec")
    if mpiexec is None:
        raise FileNotFoundError("mpiexec not found: pip install mpich (or install a system MPI)")
    argv = [sys.executable if a == "python" else a for a in argv]
    try:
        return subprocess.run([mpiexec, "-n", str(n), *argv], env={**environ(), **(env or {})}, cwd=cwd, text=True,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ProcessFailure(f"mpiexec -n {n} {' '.join(argv)} did not finish within {timeout:.0f}s:\n"
                             f"{exc.stdout}\n{exc.stderr}") from exc
