"""Run a script as a multi-node job on an :class:`~memrt.cluster.EmulatedCluster` (2 nodes x N ranks).

Each rank gets the variables torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR = node 0's address, MASTER_PORT) and runs inside its node's network namespace, so
``memrt.comm.init_process_group()`` (or torch's, with env://) works unchanged and the ranks of
different nodes talk through the rate-limited link. Output goes to files (no pipe can fill up);
every process is reaped on timeout or failure.

    from memrt.cluster import EmulatedCluster
    from memrt.cluster.launch import run_on_cluster
    with EmulatedCluster("1gbit") as c:
        results = run_on_cluster(["python", "bench.py", "--worker"], cluster=c)
    print(results[0].stdout)
"""

from __future__ import annotations

import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from memrt.cluster.emulated import EmulatedCluster

__all__ = ["RankResult", "run_on_cluster"]


@dataclass(kw_only=True, slots=True)
class RankResult:
    """What one rank printed and how it ended."""

    rank: int
    node: int
    returncode: int
    stdout: str
    stderr: str


def run_on_cluster(argv: Sequence[str], *, cluster: EmulatedCluster | None = None, rate: str = "1gbit",
                   ranks_per_node: int | Sequence[int] = 2, env: Mapping[str, str] | None = None,
                   timeout_s: float = 600.0, check: bool = True) -> list[RankResult]:
    """Start ``argv`` once per rank (``"python"`` = this interpreter) and wait for all; results by rank.

    ``ranks_per_node`` is a count per node or one count for both (uneven nodes: ``(3, 1)``). Without
    ``cluster`` a fresh one at ``rate`` is built and removed. ``check`` raises RuntimeError naming the
    ranks that failed, with the end of their output.
    """
    if cluster is None:
        with EmulatedCluster(rate) as c:
            return run_on_cluster(argv, cluster=c, ranks_per_node=ranks_per_node, env=env, timeout_s=timeout_s,
                                  check=check)
    per_node = [ranks_per_node] * 2 if isinstance(ranks_per_node, int) else list(ranks_per_node)
    if len(per_node) != 2 or min(per_node) < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} is not valid: expected a count >= 1 or two of them")
    world = sum(per_node)
    # fresh namespaces: nothing else listens there; OS entropy leaves the user's `random` untouched
    port = random.SystemRandom().randint(20000, 40000)
    procs: list[tuple[int, int, subprocess.Popen, Path, Path]] = []
    tmp = tempfile.TemporaryDirectory(prefix="memrt-cluster-")
    try:
        rank = 0
        for node, count in enumerate(per_node):
            for local in range(count):
                rank_env = dict(env or {})
                rank_env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                                LOCAL_WORLD_SIZE=str(count), MASTER_ADDR=cluster.addrs[0], MASTER_PORT=str(port))
                out, err = Path(tmp.name) / f"{rank}.out", Path(tmp.name) / f"{rank}.err"
                with open(out, "w") as fo, open(err, "w") as fe:
                    p = cluster.popen(node, list(argv), env=rank_env, stdout=fo, stderr=fe)
                procs.append((rank, node, p, out, err))
                rank += 1
        deadline = time.monotonic() + timeout_s
        for r, _, p, _, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        results = []
        timed_out = []
        for r, node, p, out, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
                timed_out.append(r)
            results.append(RankResult(rank=r, node=node, returncode=p.returncode, stdout=out.read_text(),
                                      stderr=err.read_text()))
    finally:
        for _, _, p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        tmp.cleanup()
    if check:
        bad = [res for res in results if res.returncode != 0]
        if bad or timed_out:
            detail = "".join(f"\n--- rank {res.rank} (exit {res.returncode}):\n{res.stderr[-2000:]}" for res in bad)
            raise RuntimeError(f"run_on_cluster: rank(s) {[b.rank for b in bad]} failed"
                               + (f", rank(s) {timed_out} timed out after {timeout_s:.0f} s" if timed_out else "")
                               + detail)
    return results
