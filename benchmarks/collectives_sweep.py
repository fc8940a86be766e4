"""Collectives sweep in nccl-tests terms: gloo, MPI (mpi4py + MPICH) and memrt per algorithm.

Command (full sweep 1 KiB .. 256 MiB, loopback + emulated cluster at 1 and 10 Gbit/s; root for the
emulated cluster, which is skipped with a printed reason otherwise; --quick: 1 KiB .. 1 MiB, loopback, < 60 s):

    cd /work/main && .venv/bin/python -m benchmarks.collectives_sweep [--quick] [--nets loopback,1gbit,10gbit]
        [--impls gloo,mpi,memrt-flat,memrt-hier,memrt-auto] [--ops all_reduce,all_gather,reduce_scatter,broadcast]
        [--max-size 256MiB] [--out DIR]

4 ranks as 2 nodes x 2 ranks (``MEMRT_TOPOLOGY="0,1;2,3"``), float32. On the emulated cluster MPICH's ranks
are placed two per namespace by :meth:`memrt.cluster.EmulatedCluster.mpiexec_command` (UCX held to TCP). Columns follow nccl-tests
(doc/PERFORMANCE.md): size = bytes of the full buffer (all_gather: output; reduce_scatter: input),
time = mean per call over the timed iterations (slowest rank), algbw = size / time,
busbw = algbw x (2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for broadcast).
On the emulated cluster, ``bound`` is the link bound: the bytes that must cross the inter-node cut in
each direction divided by the link rate (all_reduce: size; all_gather: size/2; reduce_scatter: size/2;
broadcast: size), and ``%bound`` = bound / time. Ratios are against ``gloo`` measured in the same run.

``auto vs best`` (per op and size): memrt-auto's time against the better of flat and hier, the algorithm
auto chose (from its comm log), the cost model's two predictions, a ``SLOWER`` flag where auto is more than
5% slower than that best (AUTO_SLACK) and ``WRONG CHOICE`` where the algorithm auto chose is. From the
``memrt-check`` arm: flat, hier and auto in one process, in rounds that cycle through every order of the
three (``memrt.comm.comm_mode``); times = medians of the rounds, auto/best = the median of the rounds'
ratios auto / best algorithm (paired in time) with its 95% confidence interval, so the three see the same
machine (separate runs of a few-millisecond call differ by tens of percent on a shared machine). A point
that the first look's rounds leave open (neither check below shows auto within 5%, nor shows it or its pick
slower) is timed again for twice as many rounds and read over all of them; each of the two looks uses a
97.5% interval, so a point is shown within with at most 5% error over both (CHECK_LOOKS, CHECK_Z). The last
line counts the points where that interval shows auto within 5% of the best, shows it slower, or cannot
tell. auto differs from the best only by noise where it picks the best, so that interval resolves slowly on a
noisy machine; the decomposed check bounds auto / best by max(1, chosen / other) x (1 + decision / chosen):
the paired ratio of the two algorithms (both timed every round; their 95% interval) times auto's measured
per-call decision cost over the chosen mode's (no collective involved).
auto's warm-up includes the timed trials it runs once per job and size class where the cost model
cannot tell flat and hier apart (:mod:`memrt.comm.measured_pick`). Without that arm, from the memrt-flat,
memrt-hier and memrt-auto arms.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from typing import Any

from benchmarks._common import (base_parser, exit_code, fail_line, failures, fmt_ratio, launch_on_nodes, machine_info,
                                machine_line, print_table, result_lines, save_plot, skip_line, write_json)

__all__ = ["main", "BUS_FACTOR", "CROSS_BYTES_FACTOR", "AUTO_SLACK", "CHECK_LOOKS", "CHECK_Z", "auto_check",
           "check_point", "is_open"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
IMPLS = ("gloo", "mpi", "memrt-flat", "memrt-hier", "memrt-auto", "memrt-check")
NODES = ((0, 1), (2, 3))


def BUS_FACTOR(op: str, n: int) -> float:
    """nccl-tests busbw factor (doc/PERFORMANCE.md): the project's one rule, memrt.profiling's."""
    from memrt.profiling.comm_log import busbw_factor

    return busbw_factor(op, n)


AUTO_SLACK = 1.05
"""memrt-auto may take at most this times the better of memrt-flat and memrt-hier (same run)."""


CROSS_BYTES_FACTOR = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}
"""Bytes each direction of the 2-node cut must carry, per byte of ``size`` (two equal nodes)."""


def _parse_size(s: str) -> int:
    from memrt.config import parse_size

    return parse_size("--max-size", s)


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


# ---------------------------------------------------------------- worker (one rank) ----
def _iters(size: int, quick: bool) -> tuple[int, int]:
    if quick:
        return 1, 3
    return (1, 3) if size >= 16 * 2**20 else (2, 10) if size >= 2**20 else (5, 30)


def _torch_call(dist, op: str, size: int, n: int):
    """(elements of the full buffer, one call of ``op`` on ``n`` ranks through ``dist``: torch.distributed or
    memrt.comm) for a buffer of about ``size`` bytes, float32, divisible by ``n``."""
    import torch

    numel = max(n, size // 4 // n * n)
    big, small = torch.ones(numel), torch.ones(numel // n)
    call = {"all_reduce": lambda: dist.all_reduce(big),
            "all_gather": lambda: dist.all_gather_into_tensor(big, small),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(small, big),
            "broadcast": lambda: dist.broadcast(big, src=0)}[op]
    return numel, call


def _torch_worker(impl: str, ops: list[str], sizes: list[int], quick: bool) -> None:
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    if impl == "gloo":
        import torch.distributed as dist
    else:
        import memrt.comm as dist
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    from memrt.profiling.recorder import get_recorder

    log = get_recorder().comm
    rows = []
    for op in ops:
        for size in sizes:
            seen = len(log)
            numel, call = _torch_call(dist, op, size, n)
            warm, iters = _iters(size, quick)
            for _ in range(warm):
                call()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)  # timing itself: plain torch.distributed
            chosen = sorted({r.algorithm for r in log[seen:] if r.op == op})  # memrt's comm log: what ran
            rows.append({"op": op, "size": numel * 4, "time_s": float(elapsed), "iters": iters,
                         "algorithm": "/".join(chosen) if chosen else None})
    if rank == 0:
        print("RESULT " + json.dumps({"impl": impl, "world": n, "rows": rows}), flush=True)
    dist.destroy_process_group()
    if impl == "gloo":  # memrt.comm's destroy does this itself
        from memrt.comm.api import let_backend_threads_finish

        let_backend_threads_finish()


CHECK_MODES = ("flat", "hier", "auto")
ORDERS = list(itertools.permutations(CHECK_MODES))
"""The rounds cycle through every order, so each mode follows each other mode equally often over every 6 rounds
(7 rounds, at 64 MiB and above, repeat one order)."""


CHECK_LOOKS = 2
"""Looks at each point of the auto check: where the first look's rounds show neither auto within AUTO_SLACK of
the best nor auto or its pick slower than that (:func:`is_open`), twice as many rounds again are timed and the
check reads all of them."""
CHECK_Z = statistics.NormalDist().inv_cdf(1 - 0.05 / (2 * CHECK_LOOKS))
"""Each look's interval is at 1 - 0.05 / CHECK_LOOKS (Bonferroni), so that over both looks a point is shown
within with at most 5% error, as one look at 95% would."""


def _check_rounds(size: int, quick: bool) -> tuple[int, int]:
    """(rounds, calls per round) of the interleaved auto check's first look at ``size``."""
    if quick:
        return 3, 2
    if size >= 64 * 2**20:
        return 7, 1  # the smallest count whose full range is a 97.5% interval of the median
    return (12, 1) if size >= 16 * 2**20 else (24, 2) if size >= 2**20 else (84, 20)


def _check_worker(ops: list[str], sizes: list[int], quick: bool) -> None:
    """memrt-check: per (op, size), flat, hier and auto in one process, interleaved round by round (the order
    cycles through every order), so that all three see the same machine; per mode the rounds' mean call times
    (slowest rank) and their median, and the cost model's reason for auto's pick. A point the first look
    leaves open gets a second (CHECK_LOOKS)."""
    import torch
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm.select import choose
    from memrt.comm.setup import STATE
    from memrt.profiling.recorder import get_recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    log = get_recorder().comm
    rows = []
    for op in ops:
        for size in sizes:
            numel, call = _torch_call(dist, op, size, n)
            rounds, calls = _check_rounds(size, quick)
            # the cost model's predictions behind auto's pick (the user's bytes: all_gather's input block)
            user_bytes = numel * 4 // n if op == "all_gather" else numel * 4
            predicted = choose(op, user_bytes, torch.float32, STATE.topology, STATE.config,
                               backend=str(tdist.get_backend())).candidates
            times: dict[str, list[float]] = {m: [] for m in CHECK_MODES}
            chosen: set[str] = set()
            for mode in CHECK_MODES:  # warm-up of each path; where the model ties, auto's first call runs the trials
                with dist.comm_mode(mode):
                    call()

            _check_rounds_run(dist, log, op, call, calls, times, chosen, 0, rounds)
            decision = _decision_seconds(op, user_bytes, chosen)
            point = _check_rows(op, numel * 4, calls, 1, times, chosen, predicted, decision)
            for look in range(2, CHECK_LOOKS + 1):
                # every rank reads the same figures (times and decision cost all-reduced, and the algorithm
                # auto ran is chosen from values equal on every rank), so all take the same branch
                if not is_open(check_point(op, numel * 4, {r["mode"]: r for r in point}, "interleaved")):
                    break
                _check_rounds_run(dist, log, op, call, calls, times, chosen, len(times["auto"]), 2 * rounds)
                again = _decision_seconds(op, user_bytes, chosen)  # an upper estimate: keep the larger
                decision = None if decision is None or again is None else max(decision, again)
                point = _check_rows(op, numel * 4, calls, look, times, chosen, predicted, decision)
            rows.extend(point)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"impl": "memrt-check", "world": n, "rows": rows}), flush=True)
    dist.destroy_process_group()


def _check_rounds_run(dist: Any, log: list, op: str, call: Any, calls: int, times: dict[str, list[float]],
                      chosen: set[str], first: int, count: int) -> None:
    """Rounds ``first`` .. ``first + count - 1`` of the interleaved check: each mode in the round's order, the
    mean call time of the slowest rank appended to ``times[mode]``; the algorithms auto ran go into ``chosen``."""
    import torch
    import torch.distributed as tdist

    for rnd in range(first, first + count):
        for mode in ORDERS[rnd % len(ORDERS)]:
            with dist.comm_mode(mode):
                seen = len(log)
                tdist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                elapsed = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
                if mode == "auto":
                    chosen.update(r.algorithm for r in log[seen:] if r.op == op)
            tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
            times[mode].append(float(elapsed))


def _check_rows(op: str, size: int, calls: int, looks: int, times: dict[str, list[float]], chosen: set[str],
                predicted: Any, decision: float | None) -> list[dict[str, Any]]:
    """One row per mode of a checked point, with a copy of its rounds' times."""
    return [{"op": op, "size": size, "mode": mode, "time_s": statistics.median(times[mode]),
             "rounds": len(times[mode]), "calls": calls, "looks": looks, "times_s": list(times[mode]),
             "algorithm": "/".join(sorted(chosen)) if mode == "auto" and chosen else mode,
             "predicted_s": predicted if mode == "auto" else None,
             "decision_s": decision if mode == "auto" else None} for mode in CHECK_MODES]


def _decision_seconds(op: str, user_bytes: int, chosen: set[str]) -> float | None:
    """An upper estimate of what choosing costs auto per call over running its chosen algorithm directly: the
    time of memrt.comm's per-call decision under ``auto`` less under the chosen mode, the largest difference
    of 7 paired batches of 1,000 decisions, the largest over the ranks (no collective runs). None when auto
    ran more than one algorithm at this size or its measured pick is not settled (deciding would take trials)."""
    import torch
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm.dispatch import decide
    from memrt.comm.measured_pick import MOVE_OPS
    from memrt.comm.setup import STATE

    if len(chosen) != 1 or (op in MOVE_OPS and not STATE.picks.settled(op, user_bytes)):
        return None

    def per_call(mode: str) -> float:
        with dist.comm_mode(mode):
            t0 = time.perf_counter()
            for _ in range(1000):
                decide(op, user_bytes, torch.float32)
            return (time.perf_counter() - t0) / 1000

    mode = next(iter(chosen))
    cost = torch.tensor([max(per_call("auto") - per_call(mode) for _ in range(7))], dtype=torch.float64)
    tdist.all_reduce(cost, op=tdist.ReduceOp.MAX)
    return max(0.0, float(cost))


def _mpi_worker(ops: list[str], sizes: list[int], quick: bool) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rows = []
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            big = np.ones(numel, dtype=np.float32)
            small = np.ones(numel // n, dtype=np.float32)
            call = {"all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, big, op=MPI.SUM),
                    "all_gather": lambda: comm.Allgather(small, big),
                    "reduce_scatter": lambda: comm.Reduce_scatter_block(big, small, op=MPI.SUM),
                    "broadcast": lambda: comm.Bcast(big, root=0)}[op]
            warm, iters = _iters(size, quick)
            for _ in range(warm):
                call()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            t = comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)
            rows.append({"op": op, "size": numel * 4, "time_s": t, "iters": iters})
    if rank == 0:
        print("RESULT " + json.dumps({"impl": "mpi", "world": n, "rows": rows}), flush=True)


# ---------------------------------------------------------------- driver ----
def _run_impl(impl: str, net: str, cluster: Any, ops: list[str], sizes: list[int], quick: bool) -> dict | None:
    base = ["python", "-m", "benchmarks.collectives_sweep", "--worker", impl, "--ops", ",".join(ops),
            "--sizes", ",".join(map(str, sizes))] + (["--quick"] if quick else [])
    if impl == "mpi":
        from memrt.testing import run_mpi

        try:
            import mpi4py  # noqa: F401
            if cluster is not None:  # 2 ranks in each namespace, Hydra's proxies started there
                proc = _run_mpi_on_cluster(cluster, base)
            else:
                proc = run_mpi(base, 4, timeout=900)
        except (ImportError, FileNotFoundError) as exc:
            skip_line(f"mpi@{net}", f"{exc} (pip install mpi4py mpich)")
            return None
        if proc.returncode != 0:
            fail_line(f"mpi@{net}", f"mpiexec failed: {proc.stderr.strip()[-400:]}")
            return None
        outs = [(0, proc.stdout, proc.stderr)]
    else:
        env = {"MEMRT_TOPOLOGY": "0,1;2,3"}
        if impl.startswith("memrt-") and impl != "memrt-check":
            env["MEMRT_COMM"] = impl.split("-", 1)[1]
    try:
        if impl != "mpi":
            # the check arm's second looks at 64-256 MiB take minutes each on a slow link
            outs = launch_on_nodes(base, nodes=NODES, cluster=cluster, env=env,
                                   timeout_s=3600 if impl == "memrt-check" else 1800)
        return result_lines(outs)[0]
    except Exception as exc:  # noqa: BLE001 - a failing implementation fails the benchmark
        fail_line(f"{impl}@{net}", f"{type(exc).__name__}: {exc}")
        return None


def _run_mpi_on_cluster(cluster: Any, argv: list[str]) -> Any:
    import subprocess
    import tempfile

    from memrt.testing import venv_bin

    mpiexec = venv_bin("mpiexec")
    if mpiexec is None:
        raise FileNotFoundError("mpiexec not found")
    with tempfile.TemporaryDirectory(prefix="memrt-mpi-") as tmp:
        cmd = cluster.mpiexec_command(mpiexec, 2, argv, tmp)
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(cmd, 124, exc.stdout or "", f"timed out after 1800 s: {exc.stderr}")


def _memrt_available() -> str | None:
    try:
        import memrt.comm as mc

        mc.init_process_group  # noqa: B018
        return None
    except Exception as exc:  # noqa: BLE001 - memrt is what is measured: its arms fail
        return f"memrt.comm not importable: {exc}"


def run_net(net: str, impls: list[str], ops: list[str], sizes: list[int], quick: bool) -> dict[str, Any]:
    from contextlib import nullcontext

    from memrt.cluster import EmulatedCluster, can_emulate

    if net != "loopback":
        ok, why = can_emulate()
        if not ok:
            return {"net": net, "skipped": skip_line(f"net {net}", why)}
    ctx = EmulatedCluster(net) if net != "loopback" else nullcontext()
    results: dict[str, Any] = {}
    rate_bps = None
    with ctx as cluster:
        if cluster is not None:
            rate_bps = cluster.rate_bps
            print(f"# {net}: measured TCP rate node1->node0 {cluster.measure_rate(1.0) / 1e9:.2f} Gbit/s", flush=True)
        why = _memrt_available()
        for impl in impls:
            if impl.startswith("memrt") and why:
                fail_line(impl, why)
                continue
            print(f"running {impl} on {net} ...", flush=True)
            r = _run_impl(impl, net, cluster, ops, sizes, quick)
            if r:
                results[impl] = r
    return {"net": net, "rate_bps": rate_bps, "results": results}


def _table(res: dict[str, Any], op: str) -> list[list[str]]:
    n = 4
    by = {impl: {row["size"]: row for row in r["rows"] if row["op"] == op} for impl, r in res["results"].items()
          if impl != "memrt-check"}  # its rows are the auto check's (auto_check)
    gloo = by.get("gloo", {})
    sizes = sorted({s for d in by.values() for s in d})
    out = []
    for impl, rows in by.items():
        for s in sizes:
            row = rows.get(s)
            if row is None:
                continue
            t = row["time_s"]
            algbw = s / t / 1e9
            bound = (CROSS_BYTES_FACTOR[op] * s * 8 / res["rate_bps"]) if res["rate_bps"] else None
            row.update(algbw_GBps=algbw, busbw_GBps=algbw * BUS_FACTOR(op, n), bound_s=bound,
                       vs_gloo=(gloo[s]["time_s"] / t) if s in gloo else None)
            out.append([impl, f"{s}", f"{s // 4}", "float", f"{t * 1e6:.1f}", f"{algbw:.3f}",
                        f"{row['busbw_GBps']:.3f}", f"{bound * 1e6:.0f}" if bound else "-",
                        f"{100 * bound / t:.0f}%" if bound else "-", fmt_ratio(row["vs_gloo"])])
    return out


def auto_check(res: dict[str, Any], op: str) -> list[dict[str, Any]]:
    """Per size: memrt-auto's time vs the better of flat and hier; ``slower`` when auto takes more than
    AUTO_SLACK x that best, ``wrong`` when auto chose the other algorithm and that one takes more than
    AUTO_SLACK x the best. From the interleaved memrt-check arm when it ran (one process, the three modes
    alternating; auto/best is the median of the rounds' paired ratios), else from the separate memrt-flat,
    memrt-hier and memrt-auto runs."""
    r = res.get("results", {})
    by: dict[int, dict[str, dict[str, Any]]] = {}
    if "memrt-check" in r:
        source = "interleaved"
        for row in r["memrt-check"]["rows"]:
            if row["op"] == op:
                by.setdefault(row["size"], {})[row["mode"]] = row
    elif all(k in r for k in ("memrt-flat", "memrt-hier", "memrt-auto")):
        source = "separate runs"
        for mode in ("flat", "hier", "auto"):
            for row in r[f"memrt-{mode}"]["rows"]:
                if row["op"] == op:
                    by.setdefault(row["size"], {})[mode] = row
    else:
        return []
    out = []
    for size in sorted(by):
        modes = by[size]
        if all(m in modes for m in ("flat", "hier", "auto")):
            out.append(check_point(op, size, modes, source))
    return out


def is_open(check: dict[str, Any]) -> bool:
    """True when a point's rounds show neither auto within AUTO_SLACK of the best (directly or by the decomposed
    bound) nor auto or its pick slower than that: another look may settle it."""
    return not (check["bound_within"] or check["shown_within"] or check["pick_wrong"] or check["shown_slower"])


def check_point(op: str, size: int, modes: dict[str, dict[str, Any]], source: str) -> dict[str, Any]:
    """auto vs the better of flat and hier at one (op, size): ``modes`` maps flat, hier and auto to their rows."""
    flat, hier, auto = modes["flat"]["time_s"], modes["hier"]["time_s"], modes["auto"]
    best_mode = "flat" if flat <= hier else "hier"
    best = min(flat, hier)
    chose = auto.get("algorithm")
    chose_s = {"flat": flat, "hier": hier}.get(chose or "")
    ratio, low, high = _paired_ratio(auto, modes[best_mode])
    row = {"op": op, "size": size, "auto_s": auto["time_s"], "flat_s": flat, "hier_s": hier,
           "best": best_mode, "auto_chose": chose, "source": source,
           "predicted_s": auto.get("predicted_s"), "auto_over_best": ratio,
           "auto_over_best_ci95": [low, high], "slower": ratio > AUTO_SLACK,
           "shown_within": high <= AUTO_SLACK, "shown_slower": low > AUTO_SLACK,
           "wrong": chose_s is not None and chose_s > AUTO_SLACK * best,
           "rounds": auto.get("rounds"), "looks": auto.get("looks", 1)}
    row.update(_decomposed(modes, chose, auto.get("decision_s")))
    return row


def _decomposed(modes: dict[str, dict[str, Any]], chose: str | None, decision_s: float | None) -> dict[str, Any]:
    """auto's time = its chosen algorithm's time + its decision cost (the same code runs the collective), so
    auto / best <= max(1, chosen / other) x (1 + decision / chosen's time). The first factor is the paired
    ratio of the two algorithms timed in the same rounds (both run every round, so the rounds resolve it far
    sooner than auto vs best, which differ by noise alone when auto picks the best); the second is measured
    without a collective (an upper estimate). ``bound_ci95_high`` is the product at the upper end of the ratio's
    interval (95% per point over the looks, CHECK_Z; with few rounds the interval is the rounds' full range,
    which holds the median with probability 1 - 2^(1-n), at least 97.5% from 7 rounds on).
    The premise is checked: where the interval of auto / chosen (timed in the same rounds) lies above what the
    decision cost explains, the point is not counted as shown."""
    if chose not in ("flat", "hier") or decision_s is None:
        return {"pick_over_other": None, "pick_ci95": None, "decision_s": decision_s, "bound_ci95_high": None,
                "bound_within": False, "pick_wrong": False, "premise_holds": None}
    other = "hier" if chose == "flat" else "flat"
    ratio, low, high = _paired_ratio(modes[chose], modes[other])
    overhead = 1.0 + decision_s / modes[chose]["time_s"]
    bound = max(1.0, high) * overhead
    # the premise, checked: auto timed beside its chosen mode is not shown slower than the decision explains
    _, auto_low, _ = _paired_ratio(modes["auto"], modes[chose])
    premise = auto_low <= overhead
    return {"pick_over_other": ratio, "pick_ci95": [low, high], "decision_s": decision_s, "bound_ci95_high": bound,
            "bound_within": premise and bound <= AUTO_SLACK, "pick_wrong": low > AUTO_SLACK,
            "premise_holds": premise}


def _paired_ratio(auto: dict[str, Any], best: dict[str, Any]) -> tuple[float, float, float]:
    """auto's time over the best algorithm's, with a confidence interval (95% over the check's looks, CHECK_Z):
    the median of the per-round ratios when both were timed in the same interleaved rounds (a slow moment of
    the machine hits both halves of a pair) and the distribution-free interval of a median (order statistics k
    and n+1-k, k = n/2 - z sqrt(n)/2); else the ratio of the two times (interval: that ratio)."""
    import math

    a, b = auto.get("times_s"), best.get("times_s")
    if a and b and len(a) == len(b):
        ratios = sorted(x / y for x, y in zip(a, b))
        n = len(ratios)
        k = max(1, math.floor(n / 2 - CHECK_Z * math.sqrt(n) / 2))
        return statistics.median(ratios), ratios[k - 1], ratios[n - k]
    r = auto["time_s"] / best["time_s"]
    return r, r, r


def _bound_text(c: dict[str, Any]) -> str:
    b = c.get("bound_ci95_high")
    return "-" if b is None else f"{b:.3f}" + ("" if c.get("premise_holds") is not False else ", auto above its pick")


def _predicted(c: dict[str, Any]) -> str:
    p = c.get("predicted_s") or {}
    return " / ".join(f"{p[a] * 1e6:.0f}" if a in p else "-" for a in ("flat", "hier"))


def _auto_rows(checks: list[dict[str, Any]]) -> list[list[str]]:
    return [[f"{c['size']}", f"{c['auto_s'] * 1e6:.1f}", c["auto_chose"] or "-", f"{c['flat_s'] * 1e6:.1f}",
             f"{c['hier_s'] * 1e6:.1f}", c["best"], _predicted(c), f"{c['auto_over_best']:.3f}",
             "{:.3f}-{:.3f}".format(*c["auto_over_best_ci95"]),
             "-" if c.get("pick_ci95") is None
             else "{:.3f} ({:.3f}-{:.3f})".format(c["pick_over_other"], *c["pick_ci95"]),
             "-" if c.get("decision_s") is None else f"{c['decision_s'] * 1e6:.1f}",
             _bound_text(c), f"{c.get('rounds') or '-'} ({c.get('looks', 1)})",
             ", ".join(w for w, on in ((f"SLOWER (> {AUTO_SLACK:.2f}x best)", c["slower"]),
                                       ("WRONG CHOICE", c.get("wrong"))) if on) or "ok"] for c in checks]


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--worker", default=None, help=argparse_hidden())
    p.add_argument("--sizes", default=None, help=argparse_hidden())
    p.add_argument("--nets", default=None, help="loopback,1gbit,10gbit (quick: loopback)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--max-size", default=None, help="largest size (default 256MiB; quick 1MiB)")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    if args.worker:
        sizes = [int(s) for s in args.sizes.split(",")]
        if args.worker == "mpi":
            _mpi_worker(ops, sizes, args.quick)
        elif args.worker == "memrt-check":
            _check_worker(ops, sizes, args.quick)
        else:
            _torch_worker(args.worker, ops, sizes, args.quick)
        return 0
    info = machine_info()
    print(machine_line(info), flush=True)
    max_size = _parse_size(args.max_size or ("1MiB" if args.quick else "256MiB"))
    sizes = _sizes(1024, max_size)
    nets = (args.nets or ("loopback" if args.quick else "loopback,1gbit,10gbit")).split(",")
    out = []
    for net in nets:
        res = run_net(net, args.impls.split(","), ops, sizes, args.quick)
        out.append(res)
        if "results" not in res:
            continue
        res["auto_check"] = []
        for op in ops:
            print_table(["impl", "size (B)", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
                         "bound (us)", "%bound", "vs gloo"], _table(res, op),
                        title=f"{op} | {net} | 4 ranks = 2 nodes x 2 | same run, ratio = gloo time / impl time")
            checks = auto_check(res, op)
            res["auto_check"].extend(checks)
            if checks:
                print_table(["size (B)", "auto (us)", "auto chose", "flat (us)", "hier (us)", "best",
                             "predicted flat / hier (us)", "auto/best", "95% CI", "chosen/other (95% CI)",
                             "decision +us", "bound (95%)", "rounds (looks)", "check"], _auto_rows(checks),
                            title=f"{op} | {net} | memrt-auto vs the better of flat and hier ({checks[0]['source']})")
        slow = [c for c in res["auto_check"] if c["slower"]]
        wrong = [c for c in res["auto_check"] if c["wrong"]]
        if res["auto_check"]:
            print(f"# {net}: auto more than {AUTO_SLACK:.2f}x the better algorithm at {len(slow)} of "
                  f"{len(res['auto_check'])} (op, size) points"
                  + (": " + ", ".join(f"{c['op']} {c['size']} B ({c['auto_over_best']:.2f}x)" for c in slow)
                     if slow else "")
                  + f"; chose an algorithm more than {AUTO_SLACK:.2f}x the better one at {len(wrong)}"
                  + (": " + ", ".join(f"{c['op']} {c['size']} B ({c['auto_chose']})" for c in wrong)
                     if wrong else ""), flush=True)
            if args.quick:
                print(f"# {net}: --quick times 3 rounds per look: the intervals below are the rounds' range, which "
                      "holds the median with far less than 95% confidence", flush=True)
            within = [c for c in res["auto_check"] if c["shown_within"]]
            above = [c for c in res["auto_check"] if c["shown_slower"]]
            print(f"# {net}: with 95% confidence, auto within {AUTO_SLACK:.2f}x the better algorithm at {len(within)} "
                  f"of {len(res['auto_check'])} points, more than {AUTO_SLACK:.2f}x at {len(above)}"
                  + (": " + ", ".join(f"{c['op']} {c['size']} B" for c in above) if above else "")
                  + f", not resolved by the rounds at {len(res['auto_check']) - len(within) - len(above)}",
                  flush=True)
            bound = [c for c in res["auto_check"] if c.get("bound_within")]
            picked_wrong = [c for c in res["auto_check"] if c.get("pick_wrong")]
            open_ = [c for c in res["auto_check"] if not c.get("bound_within")]
            costs = [c["decision_s"] for c in res["auto_check"] if c.get("decision_s") is not None]
            print(f"# {net}: decomposed (auto = its chosen algorithm + its decision cost): with 95% confidence auto "
                  f"within {AUTO_SLACK:.2f}x the better algorithm at {len(bound)} of {len(res['auto_check'])} points; "
                  f"a pick shown more than {AUTO_SLACK:.2f}x the other algorithm at {len(picked_wrong)}"
                  + (": " + ", ".join(f"{c['op']} {c['size']} B" for c in picked_wrong) if picked_wrong else "")
                  + (f"; not shown at {len(open_)}: " + ", ".join(f"{c['op']} {c['size']} B ({_bound_text(c)})"
                                                                  for c in open_) if open_ else "")
                  + (f"; decision cost {min(costs) * 1e6:.1f}-{max(costs) * 1e6:.1f} us per call" if costs else "")
                  + f"; a second look at {sum(c.get('looks', 1) > 1 for c in res['auto_check'])}",
                  flush=True)
    write_json(args.out, "collectives_sweep", {"machine": info, "quick": args.quick, "nets": out,
                                               "failed": failures()})
    save_plot(args.out, "collectives_sweep", _plot(out, ops))
    return exit_code()


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def _plot(nets: list[dict], ops: list[str]):
    def draw(plt):
        shown = [n for n in nets if "results" in n]
        for i, net in enumerate(shown):
            for j, op in enumerate(ops):
                ax = plt.subplot(len(shown), len(ops), i * len(ops) + j + 1)
                for impl, r in net["results"].items():
                    rows = [x for x in r["rows"] if x["op"] == op]
                    ax.loglog([x["size"] for x in rows], [x["size"] / x["time_s"] / 1e9 for x in rows],
                              marker=".", label=impl)
                ax.set_title(f"{op} {net['net']}", fontsize=7)
                ax.tick_params(labelsize=6)
                if i == 0 and j == 0:
                    ax.legend(fontsize=5)
                    ax.set_ylabel("algbw GB/s", fontsize=7)
    return draw


if __name__ == "__main__":
    sys.exit(main())
