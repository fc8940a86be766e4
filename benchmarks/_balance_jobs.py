"""The job scenarios of benchmarks/mixed_cluster.py: standalone speeds, stock DDP and MEMRT=1 of one unchanged job.

Each rank of ``benchmarks/balance_job.py`` is started through a small shim that caps its own CPU share
(``MEMRT_CPU_CAP``, :func:`memrt.cluster.cpucap.cap_from_setting`) and then ``exec``s the job, so the job's
process — the same pid — runs under the cap and the job itself stays unchanged.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks._common import fmt_ratio, launch_on_nodes, print_table
from memrt.cluster.cpucap import can_cap, can_cap_threads, remove_stale_caps

__all__ = ["SCENARIOS", "run_job", "print_job_table"]

JOB = Path(__file__).resolve().parent / "balance_job.py"
# Capping needs the host's /sys/fs/cgroup, which `ip netns exec` hides: cap first, then enter the namespace.
_SHIM = ("import os, sys\n"
         "from memrt.cluster.cpucap import cap_from_setting\n"
         "cap = cap_from_setting(int(os.environ['RANK']))  # held: a dropped CpuCap lifts the cap\n"
         "ns = os.environ.pop('BALANCE_NETNS', '')\n"
         "argv = [sys.executable, *sys.argv[1:]]\n"
         "os.execvp('ip', ['ip', 'netns', 'exec', ns, *argv]) if ns else os.execv(sys.executable, argv)\n")

SCENARIOS: dict[str, dict[str, Any]] = {
    "pair": {"caps": [1.0, 0.5], "nodes": [[0, 1]]},
    "equal": {"caps": [1.0, 1.0], "nodes": [[0, 1]]},
    "quad": {"caps": [1.0, 1.0, 0.5, 0.25], "nodes": [[0, 1, 2, 3]]},
    "uneven": {"caps": [1.0, 1.0, 1.0, 0.25], "nodes": [[0, 1, 2], [3]], "cluster": True},
}


BATCH = 1024
"""Per-rank batch b of the job (global batch b x world): large enough that per-step fixed costs (the 3.3 MB
gradient all-reduce, the optimizer step) stay small next to compute, as in training jobs that care about
throughput (at b = 256 the all-reduce alone is about a third of an equal-ranks step on this 2-core machine)."""

CAP_MODES = ("compute", "process")
"""What a cap slows: the rank's compute thread only (its communication threads run free, as a slow
accelerator slows its compute, not its network), or the whole process (communication at the capped speed
too, like a CPU-only helper rank)."""


JOB_SHAPE = {"samples": 65536, "features": 64, "width": 512, "depth": 4, "classes": 10, "lr": 0.01}
"""The job's data and model (its defaults: 64 features, 10 classes; SGD with momentum 0.9, mean loss)."""


def _job_args(quick: bool, out: Path, standalone: bool = False, batch: int = BATCH) -> list[str]:
    steps, warmup, seconds = (40, 25, 4) if quick else (100, 30, 10)
    timed = ["--timed-seconds", str(seconds)] if standalone else []
    return ["--batch", str(batch if not quick else 64), "--samples", str(JOB_SHAPE["samples"]), "--steps", str(steps),
            "--warmup", str(warmup), "--width", str(JOB_SHAPE["width"]), "--depth", str(JOB_SHAPE["depth"]),
            "--lr", str(JOB_SHAPE["lr"]), *timed, "--out", str(out)]


def split_reference(steps_by_rank: list[list[list[int]]], shape: dict[str, Any] = JOB_SHAPE, *,
                    weighted: bool = True) -> list[Any]:
    """Final parameters of the job trained in one process on the same global batches, each step's gradient
    formed from the ranks' parts with the arithmetic of the balanced DDP hook: each part's gradient of its
    mean loss times ``n_r * W / B`` (skipped where that is 1, as under the stock split), divided by the ranks
    ``W``, summed in rank order (for two ranks the order of a sum does not matter; for more, the backend's
    ring may add in another order). Two splits of the same batches give the same mean gradient up to
    rounding; the training run shows how far that rounding carries. ``weighted=False``: every part weighted
    1/W (DDP's average, right only for equal parts)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.balance_job import Points, make_model

    if len({len(steps) for steps in steps_by_rank}) != 1:
        raise ValueError(f"the ranks ran different step counts: {[len(s) for s in steps_by_rank]}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = Points(shape["samples"], shape["features"], shape["classes"])
        model = make_model(shape["features"], shape["width"], shape["depth"], shape["classes"])
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=shape["lr"], momentum=0.9)
        world = len(steps_by_rank)
        for parts in zip(*steps_by_rank):
            total = sum(len(p) for p in parts)
            summed: list[Any] | None = None
            for part in parts:
                if not part:
                    continue
                idx = torch.tensor(part, dtype=torch.long)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
                factor = len(part) * world / total if weighted else 1.0
                grads = [(p.grad if factor == 1.0 else p.grad.mul(factor)).div(world) for p in params]
                summed = grads if summed is None else [a + g for a, g in zip(summed, grads)]
            for p, g in zip(params, summed or []):
                p.grad = g
            opt.step()
        return [p.detach() for p in params]
    finally:
        torch.set_num_threads(threads)


def _cap_env(caps: list[float], ranks: list[int], priority: float, capped: bool,
             threads: str = "compute") -> tuple[dict[str, str], str]:
    """(environment, description) making rank ranks[i] run at caps[ranks[i]] CPU (``threads``: CAP_MODES)."""
    if capped:
        suffix = ":compute" if threads == "compute" else ""
        items = [f"{i}={'max' if caps[r] >= 1.0 else caps[r]}@{priority}{suffix}" for i, r in enumerate(ranks)]
        what = "compute thread" if suffix else "whole process"
        return {"MEMRT_CPU_CAP": ",".join(items)}, f"cgroup CPU caps {'/'.join(f'{caps[r]:g}' for r in ranks)} ({what})"
    # no root: a sleep per sample that makes a rank about 1/c times slower than an uncapped one (~0.25 ms/sample)
    items = [f"{i}={0.00025 * (1 / caps[r] - 1):.6f}" for i, r in enumerate(ranks) if caps[r] < 1.0]
    return {"BALANCE_JOB_DELAY": ",".join(items)}, "sleep per sample (no root)"


def _launch(nodes: list[list[int]], env: dict[str, str], out: Path, quick: bool, cluster: Any = None,
            standalone: bool = False, batch: int = BATCH) -> list[dict]:
    argv = ["python", "-c", _SHIM, str(JOB), *_job_args(quick, out, standalone, batch)]
    node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}

    def placement(rank: int) -> dict[str, str]:  # the namespace of the rank's node, entered by the shim
        if cluster is None:
            return {}
        i = node_of[rank]
        return {"BALANCE_NETNS": cluster.nodes[i], "GLOO_SOCKET_IFNAME": cluster.ifaces[i],
                "MASTER_ADDR": cluster.addrs[0]}

    outputs = launch_on_nodes(argv, nodes=nodes, env={"OMP_NUM_THREADS": "1", **env}, timeout_s=900,
                           rank_env=placement)
    bad = [(i, rc, err) for i, (rc, _, err) in enumerate(outputs) if rc != 0]
    if bad:
        raise RuntimeError(f"rank {bad[0][0]} exited {bad[0][1]}: {bad[0][2][-2000:]}")
    world = sum(len(n) for n in nodes)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
    ranks[0]["stderr"] = "".join(err for _, _, err in outputs)
    return ranks


def _fair_cpus(caps: list[float], cores: int) -> list[float]:
    """CPUs each single-threaded rank gets when all run at once on ``cores`` with equal weights: the cores
    shared evenly, no rank above its cap (water-filling)."""
    alloc = [0.0] * len(caps)
    rest, left = list(range(len(caps))), float(cores)
    while rest:
        level = left / len(rest)
        below = [r for r in rest if min(caps[r], 1.0) < level]
        if not below:
            for r in rest:
                alloc[r] = level
            break
        for r in below:
            alloc[r] = min(caps[r], 1.0)
            left -= alloc[r]
            rest.remove(r)
    return alloc


def _check_slowdown(caps: list[float], speeds: dict[int, float], how: str) -> None:
    """The emulation must work: run alone (all at once), a capped rank must be about as much slower than an
    uncapped one as its share of the cores says (a cap that silently did nothing, or one at or above the
    rank's share of a crowded machine, would make every figure of the scenario meaningless)."""
    import os

    full = [r for r, c in enumerate(caps) if c >= 1.0]
    if not full:
        return
    alloc = _fair_cpus(caps, os.cpu_count() or 1)
    fastest = max(speeds[r] for r in full)
    for r, c in enumerate(caps):
        if c >= 1.0:
            continue
        expected = alloc[r] / max(alloc[q] for q in full)
        if expected > 0.9:
            raise RuntimeError(f"{how}: rank {r}'s cap {c:g} cannot slow it on {os.cpu_count()} cores (its share "
                               f"of the cores is {alloc[r]:.2f} CPU anyway); lower the cap")
        if speeds[r] > (expected + 0.25) * fastest:
            raise RuntimeError(f"{how}: rank {r} (cap {c:g}) ran alone at {speeds[r]:.0f} samples/s, "
                               f"{speeds[r] / fastest:.2f}x an uncapped rank's {fastest:.0f} (expected about "
                               f"{expected:.2f}x): the slowdown did not take effect")


def _samples_per_s(ranks: list[dict]) -> float:
    return sum(r["timed_local_samples"] for r in ranks) / ranks[0]["timed_seconds"]


def _standalone(caps: list[float], priority: float, capped: bool, cap: str, base: dict[str, str], tmp: Path,
                quick: bool, batch: int) -> dict[int, float]:
    """Every rank alone, all at once (the same caps, the same contention for cores), each as its own one-rank
    job timed for the same number of seconds after its warm-up, so the windows overlap: samples/s per rank."""
    speeds: dict[int, float] = {}
    errors: list[str] = []

    def alone(r: int) -> None:
        env, _ = _cap_env(caps, [r], priority, capped, cap)
        try:
            speeds[r] = _samples_per_s(_launch([[0]], {**base, **env}, tmp / f"alone{r}", quick,
                                               standalone=True, batch=batch))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {exc}")

    threads = [threading.Thread(target=alone, args=(r,)) for r in range(len(caps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("standalone runs failed: " + "; ".join(errors))
    return speeds


def homogeneous_caps(caps: list[float]) -> list[float]:
    """The same total CPU cap spread evenly over the ranks: the homogeneous cluster a mixed one is compared with."""
    return [sum(caps) / len(caps)] * len(caps)


def run_job(name: str, quick: bool, priority: float = 1.0, repeats: int = 1, *, batch: int = BATCH,
            cap: str = "compute") -> dict[str, Any]:
    """One scenario, ``repeats`` times: standalone speeds (all ranks at once, one-rank jobs; their sum is the
    bound), stock DDP and MEMRT=1; where the caps differ, also the homogeneous reference: the standalone speeds and
    stock DDP of the same ranks each capped at the caps' mean (:func:`homogeneous_caps`), whose fraction of its own
    bound is what synchronous data parallelism reaches on this machine with nothing to balance. Round i starts with
    the i-th arm, modulo the arms (medians reported); returns the row. ``cap``: CAP_MODES (``compute`` where only whole
    processes can be capped: ``process``, printed); ``batch``: per-rank b (``quick``: 64)."""
    if cap not in CAP_MODES:
        raise ValueError(f"cap={cap!r} is not valid: expected one of {CAP_MODES}")
    import statistics

    import torch

    sc = SCENARIOS[name]
    capped, why = can_cap()
    if capped and cap == "compute":
        threads_ok, why_not = can_cap_threads()
        if not threads_ok:
            print(f"note: {name}: {why_not}: capping whole processes instead", flush=True)
            cap = "process"
    caps, nodes = sc["caps"], sc["nodes"]
    world = len(caps)
    tmp = Path(tempfile.mkdtemp(prefix=f"memrt-bal-{name}-"))
    base = {k: "" for k in ("MEMRT", "MEMRT_BALANCE")}
    cluster = None
    topology = {"MEMRT_TOPOLOGY": ";".join(",".join(map(str, n)) for n in nodes)} if len(nodes) > 1 else {}
    if sc.get("cluster"):
        from memrt.cluster import EmulatedCluster, can_emulate

        if can_emulate()[0]:
            cluster = EmulatedCluster("1gbit")
    even = homogeneous_caps(caps)
    reference = len(set(caps)) > 1
    try:
        env, how = _cap_env(caps, list(range(world)), priority, capped, cap)
        even_env, _ = _cap_env(even, list(range(world)), priority, capped, cap)
        if cluster is not None:
            cluster.__enter__()
        alone_sps: dict[str, list[list[float]]] = {"alone": [], "even alone": []}
        sps: dict[str, list[float]] = {"stock": [], "memrt": [], "even stock": []}
        last: dict[str, list[dict]] = {}  # each job arm's latest run (its parameters, its report)
        for i in range(repeats):
            report = tmp / f"report{i}"
            arms = {"stock": {**base, **env}, "even stock": {**base, **even_env},
                    "memrt": {**base, **env, **topology, "MEMRT": "1", "MEMRT_REPORT_DIR": str(report)}}
            order = ("alone", "stock", "memrt", *(("even alone", "even stock") if reference else ()))
            k = i % len(order)
            for arm in order[k:] + order[:k]:  # round i starts with arm i, modulo the arms (the machine drifts)
                if arm in alone_sps:
                    speeds = _standalone(caps if arm == "alone" else even, priority, capped, cap, base, tmp, quick,
                                         batch)
                    if arm == "alone":  # even caps slow no rank below another: nothing to check
                        _check_slowdown(caps, speeds, how=how)
                    alone_sps[arm].append([speeds[r] for r in range(world)])
                else:
                    last[arm] = _launch(nodes, arms[arm], tmp / arm.replace(" ", "_"), quick, cluster, batch=batch)
                    sps[arm].append(_samples_per_s(last[arm]))
    finally:
        if cluster is not None:
            cluster.close()
        if capped:
            remove_stale_caps()
    stock, memrt = last["stock"], last["memrt"]
    stock_sps, memrt_sps = sps["stock"], sps["memrt"]
    bounds = [sum(run) for run in alone_sps["alone"]]
    bound = statistics.median(bounds)
    speeds = {r: statistics.median(run[r] for run in alone_sps["alone"]) for r in range(world)}
    even_bounds = [sum(run) for run in alone_sps["even alone"]]
    even_over_bound = (statistics.median(sps["even stock"]) / statistics.median(even_bounds)) if reference else None
    sps_stock, sps_memrt = statistics.median(stock_sps), statistics.median(memrt_sps)
    p_stock, p_memrt = torch.load(f"{tmp}/stock.params.pt"), torch.load(f"{tmp}/memrt.params.pt")
    # the same batches in one process, split as stock split them and as MEMRT=1 did: how far rounding alone
    # carries two computations of the same mean gradients apart over the run
    ref_stock, ref_memrt = split_reference([r["steps"] for r in stock]), split_reference([r["steps"] for r in memrt])
    reports = sorted(report.glob("rank*.json"))
    balance = json.loads(reports[0].read_text())["meta"]["activation"]["balance"] if reports else None
    loss_s, loss_m = stock[0]["final_loss"], memrt[0]["final_loss"]
    return {
        "scenario": name, "world": world, "nodes": nodes, "emulated_cluster": cluster is not None,
        "caps": caps, "slowdown": how, "cap_unavailable": None if capped else why,
        "standalone_samples_per_s": [speeds[r] for r in range(world)], "bound_samples_per_s": bound,
        "stock_samples_per_s": sps_stock, "memrt_samples_per_s": sps_memrt,
        "memrt_over_stock": sps_memrt / sps_stock, "stock_runs": stock_sps, "memrt_runs": memrt_sps,
        "bound_runs": bounds, "memrt_over_bound": sps_memrt / bound,
        "stock_over_bound": sps_stock / bound,
        "homogeneous_caps": even if reference else None, "homogeneous_bound_runs": even_bounds,
        "homogeneous_stock_runs": sps["even stock"], "homogeneous_stock_over_bound": even_over_bound,
        "final_loss_stock": loss_s, "final_loss_memrt": loss_m, "loss_rel_diff": abs(loss_m - loss_s) / abs(loss_s),
        "params_allclose_rtol_1e-4": all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(p_memrt, p_stock)),
        "max_param_diff": _max_diff(p_memrt, p_stock),
        "max_param_diff_split_references": _max_diff(ref_memrt, ref_stock),
        "max_param_diff_stock_vs_its_reference": _max_diff(p_stock, ref_stock),
        "max_param_diff_memrt_vs_its_reference": _max_diff(p_memrt, ref_memrt),
        "shares": balance["shares"] if balance else None,
        "decisions": [(d["step"], d["shares"], d["changed"]) for d in balance["decisions"]] if balance else None,
        "global_batch": (64 if quick else batch) * world, "cap_threads": cap,
    }


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def print_job_table(rows: list[dict[str, Any]]) -> None:
    print_table(["scenario", "ranks (nodes)", "caps (slowed)", "B", "standalone samples/s", "bound", "stock", "MEMRT=1",
                 "MEMRT=1/stock", "MEMRT=1/bound", "homogeneous: stock/its bound", "loss diff", "params allclose",
                 "max param diff: MEMRT=1-stock / split refs", "shares"],
                [[r["scenario"], f"{r['world']} ({'+'.join(str(len(n)) for n in r['nodes'])}"
                  f"{', emulated' if r['emulated_cluster'] else ''})",
                  "/".join(f"{c:g}" for c in r["caps"]) + f" ({r['cap_threads']})",
                  r["global_batch"], " + ".join(f"{s:.0f}" for s in r["standalone_samples_per_s"]),
                  f"{r['bound_samples_per_s']:.0f}", f"{r['stock_samples_per_s']:.0f}", f"{r['memrt_samples_per_s']:.0f}",
                  fmt_ratio(r["memrt_over_stock"]), f"{100 * r['memrt_over_bound']:.0f}%",
                  "-" if r["homogeneous_stock_over_bound"] is None else
                  f"{100 * r['homogeneous_stock_over_bound']:.0f}% (caps {r['homogeneous_caps'][0]:g})",
                  f"{100 * r['loss_rel_diff']:.2f}%", r["params_allclose_rtol_1e-4"],
                  f"{r['max_param_diff']:.1e} / {r['max_param_diff_split_references']:.1e}", r["shares"]] for r in rows],
                title="unchanged DDP job: MEMRT=1 vs stock DDP vs the bound (sum of standalone speeds), one run")
    print("split refs: the same global batches trained in one process, each step's gradient formed from the ranks' "
          "parts (each part's mean-loss gradient weighted by its share) as stock split them and as MEMRT=1 did; their "
          "difference is what rounding alone carries over the run, with no communication in it", flush=True)
    print("homogeneous: the same ranks each capped at the caps' mean (the same total), stock DDP against the sum of "
          "their own standalone speeds: what synchronous data parallelism reaches here with nothing to balance",
          flush=True)
    for r in rows:
        if r["cap_unavailable"]:
            print(f"note: {r['scenario']}: no CPU cap ({r['cap_unavailable']}); {r['slowdown']}", flush=True)
