"""Start a command once per rank, as torchrun would, and reap every rank: the one launcher of memrt's tests,
benchmarks and demo.

Each rank gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK,
MASTER_ADDR, MASTER_PORT), so ``memrt.comm.init_process_group()`` (or torch's, with env://) works unchanged.
On loopback the rendezvous port is :func:`memrt.launcher.free_port`; on an
:class:`~memrt.cluster.EmulatedCluster` node i's ranks run inside namespace i and talk to node 0's address
through the rate-limited link (fresh namespaces: any port is free there). Output goes to files (no pipe can
fill up); when one rank fails the others are killed (they would wait on it until their timeout), and every
process is reaped on timeout.

    from memrt.cluster import EmulatedCluster
    from memrt.cluster.launch import launch_ranks
    with EmulatedCluster("1gbit") as c:
        results = launch_ranks(["python", "bench.py", "--worker"], ranks_per_node=(2, 2), cluster=c)
    print(results[0].stdout)
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from memrt.cluster.emulated import EmulatedCluster
from memrt.config import environ
from memrt.launcher import free_port

__all__ = ["RankResult", "first_failure", "launch_ranks", "run_on_cluster"]


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
                 timeout_s: float = 600.0, check: bool = True) -> list[RankResult]:
    """Start ``argv`` once per rank (``"python"`` = this interpreter) and wait for all; results by rank.

    Ranks are numbered node by node (node 0 holds ranks 0..ranks_per_node[0]-1). Without ``cluster`` every
    rank runs on loopback. ``env`` is added to this process's environment for every rank, ``rank_env(rank)``
    on top. ``check`` raises RuntimeError naming the rank that failed first, with the end of its output.
    """
    per_node = [int(n) for n in ranks_per_node]
    if not per_node or min(per_node) < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} is not valid: expected counts >= 1")
    if cluster is not None and len(per_node) != len(cluster.nodes):
        raise ValueError(f"ranks_per_node={ranks_per_node!r}: the emulated cluster has {len(cluster.nodes)} nodes")
    world = sum(per_node)
    addr = cluster.addrs[0] if cluster is not None else "127.0.0.1"
    # OS entropy for the namespaces' port: the user's `random` stays untouched
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
