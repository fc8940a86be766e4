"""The CUDA checks of memrt, for a lent GPU (run by benchmarks/gpu_check.sh; < 10 min on one GPU).

    cd /work/main && .venv/bin/python -m benchmarks.gpu_check [--out DIR]    # DIR defaults to $OUT or ./gpu-check

1. planner certification with CUDA allocator stats: a GPT-style model under ``memrt.auto`` at budgets
   90%, 60% of the no-checkpointing peak and the smallest feasible one; ``torch.cuda.max_memory_allocated``
   of a step after certification must be <= the budget, and gradients must equal the run without memrt;
2. CUDA frontier: none / every block / ``save_on_cpu`` / memrt at 60% (peak by the allocator, step time);
3. host-tier offload overlap: ``memrt.auto(..., offload="host")`` at the checkpoint-every-block peak and
   at 0.9x of it (where recompute alone no longer fits, so the planner must pick offload_host): peak fits,
   and step time vs keep-all and vs checkpoint every block (overlap keeps it near the recompute cost);
4. hierarchical all-reduce path with CUDA tensors (4 ranks on the one GPU, ``MEMRT_TOPOLOGY=0,1;2,3``):
   NCCL first; NCCL refuses two ranks on one device, so then gloo with CUDA tensors; correctness only:
   results equal torch.distributed's.
Each check prints PASS/FAIL/SKIP with its figures; everything goes to DIR/gpu_check.json (+ .png).
Exit status: 0 when no check FAILs (and when there is no CUDA device: it says so and does nothing).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks._common import (fmt_bytes, launch_ranks, machine_info, machine_line, print_table, result_lines,
                                save_plot, write_json)
from memrt.config import environ

__all__ = ["main"]


def _gpt(device: str):
    import torch

    from memrt.testing.models import GPT, GPTConfig, gpt_batch

    cfg = GPTConfig(vocab_size=256, seq_len=1024, n_layer=12, d_model=512, n_head=8, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    return model, gpt_batch(cfg, 8, device=device)


def _step(model, opt, batch, forward=None) -> float:
    import torch

    from memrt.testing.models import lm_loss

    x, y = batch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    lm_loss((forward or model)(x), y).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _peak_and_time(model, opt, batch, forward=None, steps: int = 3) -> tuple[int, float]:
    import torch

    times = []
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        times.append(_step(model, opt, batch, forward))
    return torch.cuda.max_memory_allocated(), sorted(times)[len(times) // 2]


def check_planner() -> dict[str, Any]:
    import torch

    import memrt

    ref, batch = _gpt("cuda")
    torch.manual_seed(1)
    _step(ref, None, batch)
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    peak_none, _ = _peak_and_time(ref, None, batch)
    rows, ok = [], True
    for label, budget in (("90%", int(0.9 * peak_none)), ("60%", int(0.6 * peak_none)), ("min", None)):
        model, _ = _gpt("cuda")
        if budget is None:  # ask for an impossible budget; BudgetError names the smallest feasible one
            try:
                memrt.auto(model, budget=1)
                _step(model, None, batch)
            except memrt.BudgetError as exc:
                budget = int(getattr(exc, "min_feasible_bytes", 0) or 0)
                if not budget:
                    rows.append({"budget": label, "status": "FAIL", "why": f"BudgetError without a size: {exc}"})
                    ok = False
                    continue
            if budget is None:
                rows.append({"budget": label, "status": "FAIL", "why": "budget=1 byte did not raise BudgetError"})
                ok = False
                continue
            memrt.disable(model)
            model, _ = _gpt("cuda")
        memrt.auto(model, budget=budget)
        for _ in range(2):  # profile, certify
            model.zero_grad(set_to_none=True)
            _step(model, None, batch)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        torch.cuda.reset_peak_memory_stats()
        _step(model, None, batch)
        peak = torch.cuda.max_memory_allocated()
        grads_equal = all(torch.equal(a, p.grad) for a, p in zip(ref_grads, model.parameters()))
        plan = memrt.plan_of(model)
        fits = peak <= budget
        ok &= fits and grads_equal
        rows.append({"budget": label, "budget_bytes": budget, "measured_peak_bytes": peak, "fits": fits,
                     "grads_bitwise_equal": grads_equal,
                     "predicted_peak_bytes": getattr(plan, "predicted_peak_bytes", None),
                     "status": "PASS" if fits and grads_equal else "FAIL"})
    print_table(["budget", "bytes", "allocator peak", "fits", "grads equal", "predicted"],
                [[r["budget"], fmt_bytes(r.get("budget_bytes")), fmt_bytes(r.get("measured_peak_bytes")),
                  r.get("fits"), r.get("grads_bitwise_equal"), fmt_bytes(r.get("predicted_peak_bytes"))]
                 for r in rows], title="1. planner certification (CUDA allocator stats)")
    return {"status": "PASS" if ok else "FAIL", "no_ckpt_peak_bytes": peak_none, "rows": rows}


def check_frontier_and_offload() -> dict[str, Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    import memrt

    def blockwise(model, ckpt):
        def fwd(idx):
            x = model.drop(model.tok(idx) + model.pos(torch.arange(idx.size(1), device=idx.device)))
            for b in model.blocks:
                x = checkpoint(b, x, use_reentrant=False) if ckpt else b(x)
            return model.head(model.ln_f(x))
        return fwd

    rows = []
    arms = [("none", lambda m: blockwise(m, False), None), ("every_block", lambda m: blockwise(m, True), None)]
    for name, make, _ in arms:
        model, batch = _gpt("cuda")
        opt = torch.optim.AdamW(model.parameters())
        peak, t = _peak_and_time(model, opt, batch, make(model))
        rows.append({"arm": name, "peak_bytes": peak, "step_s": t})
    model, batch = _gpt("cuda")
    opt = torch.optim.AdamW(model.parameters())
    fwd = blockwise(model, False)

    def on_cpu(x):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return fwd(x)
    peak, t = _peak_and_time(model, opt, batch, on_cpu)
    rows.append({"arm": "save_on_cpu", "peak_bytes": peak, "step_s": t})
    hi, lo = rows[0]["peak_bytes"], rows[1]["peak_bytes"]
    for name, budget, offload in (("memrt@60%", int(lo + 0.6 * (hi - lo)), "none"),
                                  ("memrt-host@every_block", lo, "host"),
                                  ("memrt-host@0.9*every_block", int(0.9 * lo), "host")):
        model, batch = _gpt("cuda")
        opt = torch.optim.AdamW(model.parameters())
        try:
            memrt.auto(model, budget=budget, offload=offload)
            peak, t = _peak_and_time(model, opt, batch, steps=4)
            plan = memrt.plan_of(model)
            actions = sorted({u.action for u in plan.units}) if plan else []
            rows.append({"arm": name, "budget_bytes": budget, "peak_bytes": peak, "step_s": t, "actions": actions,
                         "fits": peak <= budget})
        except Exception as exc:  # noqa: BLE001 - report and go on to the next arm
            rows.append({"arm": name, "budget_bytes": budget, "error": f"{type(exc).__name__}: {exc}"})
    t_none = rows[0]["step_s"]
    print_table(["arm", "peak", "step ms", "time/none", "budget", "actions / error"],
                [[r["arm"], fmt_bytes(r.get("peak_bytes")), f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-",
                  f"{r['step_s'] / t_none:.2f}x" if "step_s" in r else "-", fmt_bytes(r.get("budget_bytes")),
                  r.get("error") or ",".join(r.get("actions", []))] for r in rows],
                title="2-3. CUDA frontier and host-tier offload (same run, baseline: none)")
    bad = [r for r in rows if "error" in r or r.get("fits") is False]
    return {"status": "FAIL" if bad else "PASS", "rows": rows}


def _hier_worker() -> None:  # one rank of check 4 (launched as a subprocess)
    import json

    import torch
    import torch.distributed as tdist

    import memrt.comm as dist

    backend = environ().get("GPU_CHECK_BACKEND", "nccl")
    torch.cuda.set_device(0)
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    ok = True
    for numel in (1, 7, 1000003, 16 * 2**20):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(-8, 8, (numel,), generator=g).to(dtype).cuda()
            ref = x.clone()
            tdist.all_reduce(ref)
            dist.all_reduce(x)
            ok &= torch.equal(x, ref)  # small integers: every reduction order gives the same sum
    if rank == 0:
        print("RESULT " + json.dumps({"backend": backend, "world": n, "equal": bool(ok),
                                      "algorithm_topology": str(dist.get_topology().nodes)}), flush=True)
    dist.destroy_process_group()


def check_hier() -> dict[str, Any]:
    tried = []
    for backend in ("nccl", "gloo"):
        try:
            outs = launch_ranks(["python", "-m", "benchmarks.gpu_check", "--hier-worker"], nodes=((0, 1), (2, 3)),
                                env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier", "GPU_CHECK_BACKEND": backend},
                                timeout_s=180)
            r = result_lines(outs)[0]
            r["tried"] = tried
            r["status"] = "PASS" if r["equal"] else "FAIL"
            print(f"4. hierarchical all_reduce, CUDA tensors, {backend}: {r['status']} (tried before: {tried})")
            return r
        except (RuntimeError, TimeoutError) as exc:
            tried.append(f"{backend}: {str(exc)[-300:]}")
    print(f"4. hierarchical all_reduce: FAIL ({tried})")
    return {"status": "FAIL", "tried": tried}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="memrt's CUDA checks")
    p.add_argument("--out", default=None, help="directory for gpu_check.json/png (default: $OUT or ./gpu-check)")
    p.add_argument("--hier-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hier_worker:
        _hier_worker()
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run benchmarks/gpu_check.sh on a machine with a GPU)")
        return 0
    out = Path(args.out or environ().get("OUT") or "gpu-check")
    info = machine_info()
    print(machine_line(info), flush=True)
    results: dict[str, Any] = {}
    for name, fn in (("planner", check_planner), ("frontier_offload", check_frontier_and_offload),
                     ("hierarchical", check_hier)):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            traceback.print_exc()
            results[name] = {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = time.perf_counter() - t0
        torch.cuda.empty_cache()
    write_json(out, "gpu_check", {"machine": info, "results": results})
    fr = results["frontier_offload"].get("rows", [])

    def draw(plt):
        for r in fr:
            if "peak_bytes" in r:
                plt.scatter(r["peak_bytes"] / 2**20, r["step_s"] * 1e3, color="tab:red" if "memrt" in r["arm"] else "tab:blue")
                plt.annotate(r["arm"], (r["peak_bytes"] / 2**20, r["step_s"] * 1e3), fontsize=7)
        plt.xlabel("CUDA allocator peak (MiB)")
        plt.ylabel("step (ms)")
    save_plot(out, "gpu_check", draw)
    for name, r in results.items():
        print(f"{name}: {r['status']} ({r['seconds']:.0f} s)")
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
