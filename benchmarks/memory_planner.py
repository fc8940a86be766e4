"""memrt's memory planner vs hand-written activation checkpointing, same run, same model.

Run (from the repository root):

    .venv/bin/python benchmarks/memory_planner.py            # full sweep (GPT 8x256, a few minutes on 2 cores)
    .venv/bin/python benchmarks/memory_planner.py --quick    # smaller model, fewer repeats (< 60 s idle machine)
    .venv/bin/python benchmarks/memory_planner.py --model 10x256@512/8 --offload auto   # GPT 10x256, seq 512,
                                                             # batch 8, memrt with its default offload

For a GPT-style model whose activations dominate its memory, it measures every eager baseline (no
checkpointing, checkpoint every block, ``checkpoint_sequential`` with sqrt(n) segments, every k-th
block): peak live tensor bytes of a training step (CPU tracker / CUDA allocator) and step time. Then,
for budgets from the no-recompute peak down to memrt's smallest feasible budget, it runs
``memrt.auto(model, budget)`` and compares its step time with the fastest baseline that fits the
budget, timing both alternately in the same run. Prints one table; ``--json PATH`` saves the rows.
Also reports step 1 (profiling + planning) against a normal step. Target: memrt <= 1.02x.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import memrt
from memrt.memory.cache import PlanCache
from memrt.memory.meter import known_tensors, make_meter, watch_optimizers
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss


def gpt_forward(model: GPT, idx: torch.Tensor, strategy: str) -> torch.Tensor:
    """GPT.forward with a checkpointing strategy over its blocks."""
    t = idx.size(1)
    x = model.drop(model.tok(idx) + model.pos(torch.arange(t, device=idx.device)))
    n = len(model.blocks)
    if strategy == "sqrt":
        segments = max(1, int(round(math.sqrt(n))))
        x = checkpoint_sequential(torch.nn.Sequential(*model.blocks), segments, x, use_reentrant=False)
    else:
        every = 0 if strategy == "none" else 1 if strategy == "every" else int(strategy.split("-")[1])
        for i, block in enumerate(model.blocks):
            if every and i % every == 0:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
    return model.head(model.ln_f(x))


OFFLOAD = "none"
"""memrt's offload setting in this run (``--offload``)."""


class Runner:
    def __init__(self, base: GPT, cfg: GPTConfig, batch: int, device: torch.device, strategy: str = "none",
                 budget: int | None = None) -> None:
        self.model = copy.deepcopy(base).to(device)
        self.cfg, self.batch, self.device, self.strategy = cfg, batch, device, strategy
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.i = 0
        if budget is not None:
            memrt.auto(self.model, budget, offload=OFFLOAD, cache=PlanCache())

    def step(self) -> None:
        x, y = gpt_batch(self.cfg, self.batch, seed=self.i, device=self.device)
        self.i += 1
        self.opt.zero_grad()
        out = self.model(x) if self.strategy == "memrt" else gpt_forward(self.model, x, self.strategy)
        lm_loss(out, y).backward()
        self.opt.step()

    def timed(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def peak(self) -> int:
        meter = make_meter(self.device, record=False)
        x, y = gpt_batch(self.cfg, self.batch, seed=self.i, device=self.device)
        meter.start(known_tensors(self.model, [x, y]))
        self.step()
        p = meter.peak
        meter.stop()
        return p


def alternate(runners: list[Runner], repeats: int, warmup: int = 2) -> list[float]:
    """Median step seconds of each runner, timed round-robin after ``warmup`` untimed rounds; the
    order reverses every round (ABBA), so neither runner always follows the other."""
    for _ in range(warmup):
        for r in runners:
            r.step()
    times: list[list[float]] = [[] for _ in runners]
    for k in range(repeats):
        order = list(range(len(runners)))
        if k % 2:
            order.reverse()
        for i in order:
            times[i].append(runners[i].timed())
    return [statistics.median(t) for t in times]


def paired_ratio(a: Runner, b: Runner, repeats: int, warmup: int = 2) -> tuple[float, float, float]:
    """(median seconds of a, of b, geometric mean of the per-round ratios a/b), rounds in ABBA order:
    each ratio compares two steps taken back to back, so slow spells of a shared machine cancel, and
    the geometric mean over ABBA rounds cancels what going first or second in a round does to a step
    (a median of ratios would pick one side of that two-valued spread)."""
    for _ in range(warmup):
        a.step()
        b.step()
    ta, tb = [], []
    for k in range(repeats):
        if k % 2:
            y, x = b.timed(), a.timed()
        else:
            x, y = a.timed(), b.timed()
        ta.append(x)
        tb.append(y)
    ratio = math.exp(statistics.fmean(math.log(x / y) for x, y in zip(ta, tb)))
    return statistics.median(ta), statistics.median(tb), ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model and fewer repeats")
    ap.add_argument("--budgets", type=int, default=None, help="budgets in the sweep (default 5, quick 3)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per configuration")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--model", default=None, metavar="LAYERSxWIDTH@SEQ/BATCH",
                    help="another GPT (tied embeddings, dropout 0.1), e.g. 10x256@512/8")
    ap.add_argument("--offload", default="none", help="memrt's offload setting: none (default), auto, disk")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        cfg, batch = GPTConfig(n_layer=6, d_model=64, n_head=4, seq_len=128, vocab_size=256, dropout=0.1), 8
    else:
        cfg, batch = GPTConfig(n_layer=8, d_model=128, n_head=4, seq_len=256, vocab_size=256, dropout=0.1), 8
    if device.type == "cuda":
        cfg, batch = GPTConfig(n_layer=16, d_model=1024, n_head=16, seq_len=1024, vocab_size=8192, dropout=0.1), 8
    if args.model:
        import re

        m = re.fullmatch(r"(\d+)x(\d+)@(\d+)/(\d+)", args.model)
        if not m:
            raise SystemExit(f"--model {args.model!r}: expected LAYERSxWIDTH@SEQ/BATCH, e.g. 10x256@512/8")
        layers, width, seq, batch = (int(g) for g in m.groups())
        cfg = GPTConfig(n_layer=layers, d_model=width, n_head=4, seq_len=seq, vocab_size=256, dropout=0.1)
    global OFFLOAD
    OFFLOAD = args.offload
    n_budgets = args.budgets or (3 if args.quick else 5)
    repeats = args.repeats or (6 if args.quick else 12)
    watch_optimizers()
    torch.manual_seed(0)
    base = GPT(cfg)

    t_start = time.perf_counter()
    strategies = ["none", "every", "sqrt"] + [f"every-{k}" for k in (2, 3, 4) if k < cfg.n_layer]
    runners = {s: Runner(base, cfg, batch, device, s) for s in strategies}
    for r in runners.values():
        r.step()  # warm-up, creates optimizer state
    peaks = {s: r.peak() for s, r in runners.items()}
    times = dict(zip(strategies, alternate(list(runners.values()), repeats)))

    # memrt's smallest feasible budget, from its own profile
    probe = Runner(base, cfg, batch, device, "memrt", budget=1)
    probe.step()
    try:
        probe.step()
        raise SystemExit("budget=1 unexpectedly fit")
    except memrt.BudgetError as e:
        min_feasible = e.min_feasible_bytes
    memrt.disable(probe.model)
    top = peaks["none"]
    budgets = [int(top - i * (top - min_feasible) / (n_budgets - 1)) for i in range(n_budgets)]

    # step 1 overhead: memrt's profiling step (+ planning, done when step 2 starts) vs a normal step,
    # alternately, best of 3 each
    from memrt.memory import auto as auto_mod

    firsts, normals = [], []
    for _ in range(3):
        normals.append(runners["none"].timed())
        fresh = Runner(base, cfg, batch, device, "memrt", budget=budgets[0])
        fresh.step()  # warm the optimizer's first step (state creation) outside the measure
        memrt.disable(fresh.model)
        memrt.auto(fresh.model, budgets[0], offload=OFFLOAD, cache=PlanCache())
        t0 = time.perf_counter()
        fresh.step()
        auto_mod._STATES[fresh.model]._close_previous()  # close step 1 and plan, as the next forward does
        firsts.append(time.perf_counter() - t0)
        memrt.disable(fresh.model)
    step1, normal = min(firsts), min(normals)

    rows = []
    for budget in budgets:
        fits = [s for s in strategies if peaks[s] <= budget]
        mr = Runner(base, cfg, batch, device, "memrt", budget=budget)
        for _ in range(3):  # profile, plan (measured), certified
            mr.step()
        plan = memrt.plan_of(mr.model)
        row = {"budget_bytes": budget, "memrt_peak_bytes": plan.measured_peak_bytes,
               "predicted_peak_bytes": plan.predicted_peak_bytes,
               "recomputed": sum(u.action == "recompute" for u in plan.units), "units": len(plan.units)}
        if fits:
            best = min(fits, key=lambda s: times[s])
            t_memrt, t_base, ratio = paired_ratio(mr, runners[best], repeats)
            row.update(baseline=best, baseline_peak_bytes=peaks[best], baseline_seconds=t_base,
                       memrt_seconds=t_memrt, ratio=ratio)
        else:
            (t_memrt,) = alternate([mr], repeats)
            row.update(baseline=None, memrt_seconds=t_memrt, ratio=None)
        rows.append(row)
        memrt.disable(mr.model)

    mib = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    print(f"# GPT n_layer={cfg.n_layer} d_model={cfg.d_model} seq={cfg.seq_len} batch={batch} on {device}; "
          f"torch {torch.__version__}; repeats={repeats}")
    print("baselines: " + ", ".join(f"{s} {mib(peaks[s]).strip()} MiB {times[s] * 1e3:.0f} ms" for s in strategies))
    print(f"{'budget MiB':>10} {'memrt peak':>10} {'predicted':>10} {'pred/meas':>9} {'recomp':>6} "
          f"{'memrt ms':>9} {'baseline':>9} {'base peak':>9} {'base ms':>8} {'ratio':>6}")
    for r in rows:
        pm = r["predicted_peak_bytes"] / r["memrt_peak_bytes"] if r["memrt_peak_bytes"] else float("nan")
        base_s = (f"{r['baseline']:>9} {mib(r['baseline_peak_bytes']):>9} {r['baseline_seconds'] * 1e3:>8.0f} "
                  f"{r['ratio']:>6.3f}") if r.get("baseline") else f"{'(none fits)':>9} {'':>9} {'':>8} {'':>6}"
        print(f"{mib(r['budget_bytes']):>10} {mib(r['memrt_peak_bytes'] or 0):>10} {mib(r['predicted_peak_bytes']):>10} "
              f"{pm:>9.3f} {r['recomputed']:>3}/{r['units']:<2} {r['memrt_seconds'] * 1e3:>9.0f} {base_s}")
    ok_peak = all(r["memrt_peak_bytes"] is not None and r["memrt_peak_bytes"] <= r["budget_bytes"] for r in rows)
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    print(f"step 1 (profile + plan) {step1 * 1e3:.0f} ms = {step1 / normal:.2f}x a normal step "
          f"({normal * 1e3:.0f} ms); peak <= budget at every budget: {ok_peak}; "
          f"worst memrt/baseline ratio {max(ratios) if ratios else float('nan'):.3f}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "seq_len": cfg.seq_len,
                                  "batch": batch, "device": str(device)}, "baselines": {
                "peak_bytes": peaks, "seconds": times}, "step1_seconds": step1, "normal_step_seconds": normal, "rows": rows}, f, indent=1)
    return 0 if ok_peak else 1


if __name__ == "__main__":
    sys.exit(main())
