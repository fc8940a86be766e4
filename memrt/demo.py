"""``memrt demo``: a short GPT-style DDP training on this machine, stock and with memrt, side by side.

The same training (``memrt.testing.models.GPT``, gloo, AdamW) runs twice in real processes started like
torchrun starts them: first stock (``MEMRT=0``), then with memrt switched on by the environment only
(``MEMRT=1`` + ``MEMRT_BUDGET``, through ``memrt run``'s start-up hook, so no .pth is needed). The
training code is identical; memrt plans memory for the DDP model and routes its gradient all-reduce.

Printed side by side: peak memory of one training step vs the budget (both runs measured by the same
CPU tracker), tokens/s, all-reduce bytes per tier, final loss and whether the parameters are equal,
then memrt's plan. The budget defaults to 30% of the way from memrt's smallest feasible budget to its
keep-everything peak, both profiled (memrt.profile / memrt.plan) by the stock run's ranks after training.

``--nodes 2`` runs 2 ranks on each of 2 nodes: an emulated cluster (two network namespaces joined by a
rate-limited link) when run as root, else one machine with the nodes faked by ``MEMRT_TOPOLOGY``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memrt.config import environ
from memrt.sizes import format_bytes

__all__ = ["add_arguments", "run", "worker_main"]

BUDGET_POSITION = 0.3
"""Default budget: this far from memrt's smallest feasible budget (0) to its keep-everything peak (1),
both from a profile of the same DDP model taken by the stock run's ranks after their training."""

_MODEL = {"n_layer": 6, "d_model": 64, "n_head": 4, "seq_len": 128, "vocab_size": 256, "dropout": 0.1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="1 node, or 2 (emulated / faked)")
    parser.add_argument("--procs", type=int, default=2, help="processes per node (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (>= 4; default 6)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--budget", default=None,
                        help="memrt's MEMRT_BUDGET (default: 30%% of the way from memrt's smallest feasible "
                             "budget to its keep-everything peak, profiled by the stock run)")
    parser.add_argument("--rate", default="200mbit", help="inter-node link of the emulated cluster (root only)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)


# ------------------------------------------------------------------------------------------ worker side


def _checksum(model: Any) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def worker_main(args: argparse.Namespace) -> int:
    """One rank of the demo's training (started by :func:`run`; torchrun-style environment)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from memrt.profiling.cpu_tracker import CpuMemoryTracker
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**_MODEL)
    torch.manual_seed(0)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    step_s: list[float] = []
    peak = start = 0
    torch.manual_seed(1 + rank)
    for step in range(args.steps):
        x, y = gpt_batch(cfg, args.batch, seed=1000 * rank + step)
        measure = step == args.steps - 1
        tracker = CpuMemoryTracker().start() if measure else None
        t0 = time.perf_counter()
        loss = lm_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if tracker is not None:
            tracker.stop()
            peak, start = tracker.peak_bytes, tracker.start_bytes
        elif step >= 2:  # step 1 profiles, step 2 certifies the plan: time the steady state
            step_s.append(dt)
    result = {"rank": rank, "world_size": world, "peak_bytes": peak, "start_bytes": start,
              "step_seconds": sum(step_s) / max(len(step_s), 1), "tokens_per_step": args.batch * cfg.seq_len,
              "loss": float(loss.item()), "checksum": _checksum(model),  # noqa: E501
              "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "plan": None, "plan_text": None, "tier_bytes": {}, "comm_calls": 0}
    try:
        import memrt
        from memrt.profiling.recorder import get_recorder

        plan = memrt.plan_of(model)
        if plan is not None:
            result["plan"], result["plan_text"] = plan.to_dict(), str(plan)
        from memrt.activation import session

        sess = session.current()
        result["comm_hook"] = bool(sess is not None and sess.comm_hooks)
        result["memrt_failures"] = list(sess.failures) if sess is not None else []
        for record in get_recorder().comm:
            result["comm_calls"] += 1
            for tier, n in record.tier_bytes.items():
                result["tier_bytes"][tier] = result["tier_bytes"].get(tier, 0) + int(n)
    except Exception as exc:  # noqa: BLE001 - the stock run has no plan; report what there is
        result["plan_error"] = f"{type(exc).__name__}: {exc}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    flat = torch.cat([t.detach().reshape(-1).double() for _, t in sorted(model.state_dict().items())])
    flat.numpy().tofile(str(Path(args.out) / f"params{rank}.f64"))  # the parent compares the runs (no torch there)
    if args.calibrate:
        import gc

        del ddp, opt, model, x, y, loss  # the profile must see this rank's memory as the real run would
        gc.collect()
        result.update(_calibrate(cfg, args.batch, rank, world))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    from memrt.comm.api import let_backend_threads_finish

    let_backend_threads_finish()  # the stock run too: torch's own destroy leaves gloo's threads running
    return 0


def _calibrate(cfg: Any, batch: int, rank: int, world: int) -> dict[str, int]:
    """memrt's keep-all peak and smallest feasible budget for this rank's DDP model (stock run, after training).

    A fresh copy of the model in its own one-rank DDP group (same buckets as the real run), one step to
    create the optimizer state, then one profiled step (memrt.profile) and memrt.plan without a limit.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import memrt
    from memrt.testing.models import GPT, gpt_batch, lm_loss

    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    torch.manual_seed(0)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model, process_group=groups[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x, y = gpt_batch(cfg, batch, seed=rank)

    def step() -> None:
        loss = lm_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    plan = memrt.plan(memrt.profile(model, step), None)
    return {"keep_all_bytes": int(plan.keep_all_peak_bytes), "min_feasible_bytes": int(plan.min_feasible_bytes)}


# ------------------------------------------------------------------------------------------ parent side


def _argv(args: argparse.Namespace, out: Path, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "memrt.demo", "--worker", "--out", str(out), "--steps", str(args.steps),
            "--batch", str(args.batch), *extra]


def _launch(args: argparse.Namespace, out: Path, env_base: dict[str, str], cluster: Any,
            extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Start every rank, wait (bounded), return their results by rank; raise with the output on failure.

    Each rank's output goes to ``<run>-rank<N>.log`` next to ``out``. The ranks are started by
    :func:`memrt.testing.launch.launch_ranks` (torchrun's variables; on an emulated cluster one namespace per node).
    """
    env_base = {**env_base, "OMP_NUM_THREADS": "1"}
    from memrt.testing.launch import first_failure, launch_ranks

    results = launch_ranks(_argv(args, out, extra), ranks_per_node=[args.procs] * args.nodes, cluster=cluster,
                           env=env_base, timeout_s=args.timeout, check=False)
    for res in results:
        (out.parent / f"{out.name}-rank{res.rank}.log").write_text(res.stdout + res.stderr)
    bad = first_failure(results)
    if bad is not None:
        why = "timed out" if bad.timed_out else f"exit code {bad.returncode}"
        text = (out.parent / f"{out.name}-rank{bad.rank}.log").read_text()[-3000:]
        raise RuntimeError(f"memrt demo: rank {bad.rank} of the {out.name} run {why}:\n{text}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(results))]


def _stock_ring_tiers(grad_bytes: int, world: int, nodes: tuple[tuple[int, ...], ...], steps: int) -> dict[str, int]:
    """Bytes rank 0 sends in DDP's flat ring all-reduce: 2(n-1)/n x the gradients per step (NCCL/gloo ring),
    split by whether rank 0's ring neighbour is on its node (the stock run has no per-tier records)."""
    if world == 1:
        return {}
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    tier = "intra" if node_of[0] == node_of[1 % world] else "inter"
    return {tier: int(2 * (world - 1) / world * grad_bytes * steps)}


def _tiers(t: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(t.items())) or "-"


def _row(label: str, a: str, b: str) -> str:
    return f"  {label:<30} {a:<30} {b}"


def _max_param_diff(a: Path, b: Path, world: int) -> float:
    """Largest |stock - memrt| over every parameter of every rank."""
    import numpy as np

    return max(float(np.max(np.abs(np.fromfile(a / f"params{r}.f64") - np.fromfile(b / f"params{r}.f64"))))
               for r in range(world))


def _print_results(args, stock, mem, budget_bytes: int, nodes, topo_source: str, run_dir: Path,
                   banner: str, run_dir_stock: Path, run_dir_memrt: Path) -> dict[str, Any]:
    world = len(stock)
    s0, m0 = stock[0], mem[0]
    tok = lambda rs: sum(r["tokens_per_step"] for r in rs) / max(max(r["step_seconds"] for r in rs), 1e-9)  # noqa: E731
    speed_s, speed_m = tok(stock), tok(mem)
    stock_tiers = _stock_ring_tiers(s0["grad_bytes"], world, nodes, args.steps)
    same = all(a["checksum"] == b["checksum"] for a, b in zip(stock, mem))
    diff = _max_param_diff(run_dir_stock, run_dir_memrt, world)
    peak_s, peak_m = max(r["peak_bytes"] for r in stock), max(r["peak_bytes"] for r in mem)
    cfg = _MODEL
    print(f"memrt demo: GPT {cfg['n_layer']} blocks, d_model {cfg['d_model']}, seq {cfg['seq_len']}, batch "
          f"{args.batch}/rank | {world} ranks on {len(nodes)} node(s) ({topo_source}) | gloo | {args.steps} steps")
    if banner:
        print(banner)
    print(_row("", "stock", "memrt (MEMRT=1)"))
    print(_row("peak memory, 1 step (max rank)", format_bytes(peak_s), f"{format_bytes(peak_m)}"))
    print(_row("budget (MEMRT_BUDGET)", "-", f"{format_bytes(budget_bytes)}  "
               f"{'(peak within budget)' if peak_m <= budget_bytes else '(OVER budget)'}"))
    print(_row("tokens/s (all ranks)", f"{speed_s:,.0f}", f"{speed_m:,.0f}  ({speed_m / speed_s:.2f}x stock)"))
    print(_row("all-reduce bytes sent, rank 0", _tiers(stock_tiers) + " (ring model)",
               _tiers(m0["tier_bytes"]) + f" (measured, {m0['comm_calls']} calls)" if m0["comm_calls"]
               else ("memrt.comm hook on, no per-tier records" if m0.get("comm_hook")
                     else "- (memrt.comm hook not active)")))
    print(_row("final loss, rank 0", f"{s0['loss']:.6f}", f"{m0['loss']:.6f}"))
    print(_row("parameters equal on every rank", "", "yes (bitwise)" if same else
               f"no: max |difference| {diff:.3g}" + (" (hierarchical all-reduce adds in another order)"
                                                      if len(nodes) > 1 else "")))
    print(f"memrt's plan on rank 0 (budget {format_bytes(budget_bytes)}):")
    print("  " + (m0["plan_text"] or f"none ({m0.get('plan_error', 'memrt.memory not active')})").replace("\n", "\n  "))
    print(f"reports: {run_dir}  (memrt report {run_dir})")
    return {"stock": stock, "memrt": mem, "budget_bytes": budget_bytes, "tokens_per_s": [speed_s, speed_m],
            "peak_bytes": [peak_s, peak_m], "parameters_equal": same, "max_parameter_difference": diff, "nodes": [list(n) for n in nodes]}


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker_main(args)
    if args.steps < 4:
        print("memrt demo: --steps must be at least 4 (profile, certify, timed steps, measured step)", file=sys.stderr)
        return 2
    from memrt.activation.run import command_environment
    from memrt.config import parse_budget

    nodes = tuple(tuple(range(n * args.procs, (n + 1) * args.procs)) for n in range(args.nodes))
    cluster, topo_source = None, "one machine"
    base = {k: v for k, v in environ().items() if not k.startswith("MEMRT")}
    if args.nodes == 2:
        from memrt.cluster import EmulatedCluster, can_emulate

        ok, why = can_emulate()
        if ok:
            cluster, topo_source = EmulatedCluster(args.rate), f"emulated cluster, {args.rate} between nodes"
        else:
            topo_source = f"nodes faked by MEMRT_TOPOLOGY ({why})"
    work = Path(tempfile.mkdtemp(prefix="memrt-demo-"))
    try:
        run_id = time.strftime("demo-%Y%m%d-%H%M%S")
        report_dir = Path.cwd() / "memrt-report" / run_id
        try:
            if cluster is not None:
                cluster.__enter__()
            t0 = time.perf_counter()
            stock = _launch(args, work / "stock", {**base, "MEMRT": "0"}, cluster,
                            () if args.budget is not None else ("--calibrate",))
            t_stock = time.perf_counter() - t0
            if args.budget is not None:
                budget = parse_budget("--budget", args.budget)
                budget_bytes = budget.resolve(None) if budget.bytes is not None else None
                if budget_bytes is None:
                    import psutil

                    budget_bytes = budget.resolve(psutil.virtual_memory().total)
            else:
                low = max(r["min_feasible_bytes"] for r in stock)
                high = max(r["keep_all_bytes"] for r in stock)
                budget_bytes = int(low + BUDGET_POSITION * (high - low))
            ns = argparse.Namespace(budget=str(budget_bytes), offload=None, comm=None, compress=None,
                                    topology=";".join(",".join(map(str, n)) for n in nodes) if args.nodes == 2 else None,
                                    report_dir=str(report_dir), log_level=None, strict=False)
            env = command_environment(ns, base)
            env["MEMRT_RUN_ID"] = run_id
            t1 = time.perf_counter()
            mem = _launch(args, work / "memrt", env, cluster)
            t_mem = time.perf_counter() - t1
        finally:
            if cluster is not None:
                cluster.close()
        log0 = (work / "memrt-rank0.log").read_text().splitlines()
        banner = "\n".join(line for line in log0 if line.startswith("memrt"))
        summary = _print_results(args, stock, mem, budget_bytes, nodes, topo_source, report_dir, banner,
                                 work / "stock", work / "memrt")
        print(f"wall time: stock run {t_stock:.1f}s, memrt run {t_mem:.1f}s (process start-up included)")
        if args.json_out:
            summary["wall_seconds"] = [t_stock, t_mem]
            Path(args.json_out).write_text(json.dumps(summary, indent=1))
        # One node: the all-reduce is the same flat sum, so memrt must be bitwise exact. Across nodes the
        # hierarchical sum rounds differently; the difference is printed for the reader to judge.
        return 0 if summary["parameters_equal"] or args.nodes > 1 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the per-run scratch dir (logs, rank outputs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="memrt demo")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
