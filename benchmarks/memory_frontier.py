"""Memory frontier: peak memory vs step time of memrt against what users would pick instead.

Command (full, ~10 min on 2 cores; --quick < 60 s):

    cd /work/main && .venv/bin/python -m benchmarks.memory_frontier [--quick] [--workloads gpt,cnn] [--out DIR]

Workloads where activations dominate: a GPT-style model (long sequence, many layers, small vocabulary)
and a ResNet-like CNN. Arms, all measured in this one run with the same model, batch and AdamW step:

- ``none``: no checkpointing (the baseline every ratio is taken against, per workload);
- ``every_block``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
- ``sequential_sqrt``: ``checkpoint_sequential`` with sqrt(n) segments;
- ``every_k=K``: checkpoint every K-th block (K = 2, 3);
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (only where the device is not the host);
- ``compile_budget=B``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``
  (skipped in --quick: compiling takes about a minute per budget on 2 cores);
- ``sac_ilp=F``: PyTorch's selective-checkpointing ILP (``torch.distributed._tools.sac_ilp``, needs pulp);
- ``memrt@B``: ``memrt.auto(model, budget=B)`` at budgets swept from the no-checkpointing peak down to
  the checkpoint-every-block peak.

Peak = parameter + optimizer-state bytes + the step's peak resident growth (``VmHWM`` reset per step,
glibc told to mmap blocks > 64 KiB so freed tensors leave at once): an outside measure, the same for every
arm. Step time: median over rounds that interleave the arms (fair under a shared machine's load).
Output: tables, ``<out>/memory_frontier.json`` and ``<out>/memory_frontier.png``, and per baseline point
whether a memrt point dominates it (peak <= 1.02x and time <= 1.02x).
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from benchmarks._common import (PeakRss, base_parser, ensure_mmap_threshold, exit_code, fail_line, failures, format_bytes,
                                fmt_ratio, machine_info, machine_line, print_table, save_plot, skip_line, write_json)
from memrt.testing.models import ConvNet, GPT, GPTConfig, gpt_batch, lm_loss

__all__ = ["main"]

TOLERANCE = 0.02
"""Dominance tolerance: memrt's point covers a baseline point at <= 1.02x its peak and its time."""


@dataclass(kw_only=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    stem: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """Model forward up to the blocks (mirrors the model's own forward, so baselines can wrap the blocks)."""
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]
    block_input: Callable[[], torch.Tensor]


@dataclass(kw_only=True)
class Arm:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    forward: Callable[[torch.Tensor], torch.Tensor]
    peak_bytes: int = 0
    times_s: list[float] = field(default_factory=list)
    note: str = ""


def _workloads(quick: bool) -> dict[str, Workload]:
    g = GPTConfig(vocab_size=64, seq_len=256 if quick else 512, n_layer=4 if quick else 8, d_model=128 if not quick else 64,
                  n_head=4)
    gpt_bs = 2 if quick else 4

    def gpt_stem(m, idx):
        return m.drop(m.tok(idx) + m.pos(torch.arange(idx.size(1))))

    cnn_kw = dict(channels=16 if quick else 32, n_blocks=4 if quick else 8)
    cnn_x = torch.randn(8 if quick else 16, 3, 32 if quick else 64, 32 if quick else 64,
                        generator=torch.Generator().manual_seed(0))
    cnn_y = torch.randint(0, 10, (cnn_x.size(0),), generator=torch.Generator().manual_seed(1))
    return {
        "gpt": Workload(name=f"gpt(L={g.n_layer},T={g.seq_len},d={g.d_model},B={gpt_bs})",
                        build=lambda: GPT(g), batch=gpt_batch(g, gpt_bs), loss=lm_loss, stem=gpt_stem,
                        head=lambda m, x: m.head(m.ln_f(x)), blocks=lambda m: list(m.blocks),
                        block_input=lambda: torch.randn(gpt_bs, g.seq_len, g.d_model)),
        "cnn": Workload(name=f"cnn(C={cnn_kw['channels']},blocks={cnn_kw['n_blocks']},x={tuple(cnn_x.shape)})",
                        build=lambda: ConvNet(**cnn_kw), batch=(cnn_x, cnn_y), loss=nn.functional.cross_entropy,
                        stem=lambda m, x: torch.relu(m.stem(x)), head=lambda m, x: m.head(x.mean(dim=(2, 3))),
                        blocks=lambda m: list(m.blocks),
                        block_input=lambda: torch.randn(cnn_x.size(0), cnn_kw["channels"], *cnn_x.shape[2:])),
    }


def _blockwise(w: Workload, model: nn.Module, run_blocks: Callable[[list[nn.Module], torch.Tensor], torch.Tensor]):
    def forward(x):
        return w.head(model, run_blocks(w.blocks(model), w.stem(model, x)))
    return forward


def _ckpt_every(k: int):
    def run(blocks, h):
        for i, b in enumerate(blocks):
            h = checkpoint(b, h, use_reentrant=False) if i % k == 0 else b(h)
        return h
    return run


def _ckpt_sequential(blocks, h):
    return checkpoint_sequential(nn.Sequential(*blocks), max(1, round(math.sqrt(len(blocks)))), h,
                                 use_reentrant=False)


def _plain(blocks, h):
    for b in blocks:
        h = b(h)
    return h


def budget_backend(budget: float) -> Callable:
    """A torch.compile backend: inductor with ``activation_memory_budget = budget`` while it partitions.

    Arms that compile the same model class share dynamo's cache of compiled code for its ``forward``: with the
    default backend every such arm would run the graph compiled last (each budget arm measured as the last
    one). Dynamo keeps code compiled for another backend apart, so each budget arm runs its own."""
    import torch._functorch.config as fconfig
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: Any, example_inputs: Any) -> Any:
        with fconfig.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def _new_arm(w: Workload, name: str, wrap: Callable[[nn.Module], Callable]) -> Arm:
    torch.manual_seed(0)
    model = w.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Arm(name=name, model=model, opt=opt, forward=wrap(model))


def _step(w: Workload, arm: Arm) -> None:
    x, y = w.batch
    w.loss(arm.forward(x), y).backward()
    arm.opt.step()
    arm.opt.zero_grad(set_to_none=True)


def _fixed_bytes(arm: Arm) -> int:
    seen, total = set(), 0
    tensors = list(arm.model.parameters()) + [t for s in arm.opt.state.values() for t in s.values()
                                              if isinstance(t, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


# ---------------------------------------------------------------- SAC ILP (PyTorch's own) ----
_SAC_CHILD = r"""
import json, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.sac_estimator import SACEstimator
import benchmarks.memory_frontier as mf
w = mf._workloads(sys.argv[1] == "1")[sys.argv[2]]
with FakeTensorMode():
    block = w.blocks(w.build())[0]
    x = w.block_input().requires_grad_() * 1.0
    est = SACEstimator()
    with est("operator-level-benchmark"):
        block(x)
s = est.sac_mod_stats[type(block).__name__]
print(json.dumps({k: getattr(s, k) for k in ("func_names", "runtimes", "memory", "view_like_ops", "rand_ops",
                  "saved_autograd_ops", "inplace_ops", "force_store_random")}, default=str))
"""


def _sac_arms(w: Workload, key: str, quick: bool, fractions: list[float]) -> tuple[list[Arm], list[dict]]:
    try:
        import pulp  # noqa: F401
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP, SACStats
        from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError as exc:
        return [], [skip_line("sac_ilp", f"{exc} (pip install pulp)")]
    proc = subprocess.run([sys.executable, "-c", _SAC_CHILD, "1" if quick else "0", key], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
        return [], [skip_line("sac_ilp", f"SACEstimator (FakeTensorMode, operator-level-benchmark) failed on this "
                              f"device, exit {proc.returncode}: {tail!r}")]
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    raw["inplace_ops"] = [tuple(p) for p in raw["inplace_ops"]]
    stats = SACStats(**raw)
    arms, notes = [], []
    for frac in fractions:
        policy = get_optimal_checkpointing_policy_per_module(stats, frac)
        if not policy:
            notes.append(skip_line(f"sac_ilp={frac}", "ILP found no solution"))
            continue

        def context_fn(policy=policy):
            counters = {False: 0, True: 0}

            def policy_fn(ctx, op, *args, **kwargs):
                if op in OPS_TO_ALWAYS_SKIP:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                i = counters[ctx.is_recompute]
                counters[ctx.is_recompute] += 1
                save = policy[i] if i < len(policy) else 0
                return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
            return create_selective_checkpoint_contexts(policy_fn)

        def run(blocks, h, context_fn=context_fn):
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False, context_fn=context_fn)
            return h
        arms.append(_new_arm(w, f"sac_ilp={frac}", lambda m, run=run: _blockwise(w, m, run)))
    return arms, notes


# ---------------------------------------------------------------- memrt ----
def _memrt_scale(w: Workload) -> tuple[int, int] | None:
    """(smallest feasible budget, keep-all peak) of memrt's plan for this workload, from a 1-byte budget."""
    try:
        import memrt
    except ImportError:
        return None
    arm = _new_arm(w, "memrt-probe", lambda m: m)
    memrt.auto(arm.model, budget=1)
    arm.forward = arm.model
    try:
        for _ in range(2):
            _step(w, arm)
    except memrt.BudgetError as exc:
        if exc.keep_all_bytes is not None:
            return exc.min_feasible_bytes, max(exc.keep_all_bytes, exc.min_feasible_bytes)
    finally:
        memrt.disable(arm.model)
        del arm
        gc.collect()
    return None


def _memrt_arms(w: Workload, budgets: list[int]) -> tuple[list[Arm], list[dict]]:
    try:
        import memrt

        auto = memrt.auto
    except (ImportError, AttributeError) as exc:
        return [], [fail_line("memrt", f"memrt.auto is not available ({exc})")]
    arms, notes = [], []
    todo, tried = list(budgets), set()
    while todo:
        b = todo.pop(0)
        tried.add(b)
        arm = _new_arm(w, f"memrt@{format_bytes(b)}", lambda m: m)
        auto(arm.model, budget=int(b))
        arm.forward = arm.model
        try:
            for _ in range(3):  # step 1 profiles, step 2 runs the plan, step 3's start certifies it
                _step(w, arm)
        except memrt.BudgetError as exc:
            least = exc.min_feasible_bytes
            if least is None or least <= b:  # a feasible budget the measured peak did not keep: a failure
                notes.append(fail_line(arm.name, f"BudgetError: {str(exc)[:300]}"))
                continue
            # below the smallest feasible budget: memrt says so, as documented; measure that budget instead
            print(f"note {arm.name}: infeasible, smallest feasible {format_bytes(least)}; measuring that", flush=True)
            notes.append({"arm": arm.name, "infeasible": str(exc)[:300]})
            if least not in tried and least not in todo:
                todo.append(int(least))
            continue
        except Exception as exc:  # noqa: BLE001 - any other error of a memrt arm fails the benchmark
            notes.append(fail_line(arm.name, f"{type(exc).__name__}: {str(exc)[:300]}"))
            continue
        plan = memrt.plan_of(arm.model)
        if plan is not None:
            from collections import Counter

            acts = Counter(u.action for u in plan.units if u.action != "keep")
            arm.note = (", ".join(f"{n} {a}" for a, n in sorted(acts.items())) or "all kept") + \
                f" of {len(plan.units)}; memrt's own peak {format_bytes(plan.measured_peak_bytes)}"
        arms.append(arm)
    return arms, notes


def _measure(w: Workload, arms: list[Arm], rounds: int) -> list[dict]:
    """Peak then interleaved timing rounds; an arm that raises (e.g. memrt's BudgetError on re-planning)
    is dropped with a printed FAIL, which fails the benchmark. Returns those records."""
    failed: list[dict] = []

    def guarded(arm: Arm, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - report, never hide: the benchmark fails
            failed.append(fail_line(arm.name, f"{type(exc).__name__}: {str(exc)[:300]}"))
            arms.remove(arm)
            return False

    def peak(arm: Arm) -> None:  # warm-up (compile, memrt's profile + certify), then one clean step
        for _ in range(2):
            _step(w, arm)
        with PeakRss() as rss:
            _step(w, arm)
        arm.peak_bytes = _fixed_bytes(arm) + rss.delta_bytes

    for arm in list(arms):
        guarded(arm, partial(peak, arm))
    for _ in range(rounds):
        for arm in list(arms):
            t0 = time.perf_counter()
            if guarded(arm, partial(_step, w, arm)):
                arm.times_s.append(time.perf_counter() - t0)
    return failed


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run_workload(key: str, w: Workload, args) -> dict[str, Any]:
    print(f"\n=== {key}: {w.name} ===", flush=True)
    skipped: list[dict] = []
    # memrt's CPU budget counts every live CPU tensor in the process, so its arms are planned and certified
    # first, with no baseline model alive (only the two probes that set the sweep, measured then freed).
    probes = [_new_arm(w, "none", lambda m: _blockwise(w, m, _plain)),
              _new_arm(w, "every_block", lambda m: _blockwise(w, m, _ckpt_every(1)))]
    _measure(w, probes, 0)
    hi, lo = probes[0].peak_bytes, probes[1].peak_bytes
    del probes
    gc.collect()
    fracs = [1.0, 0.0] if args.quick else [1.0, 0.75, 0.5, 0.25, 0.0]
    # memrt's budgets are on its own meter's scale (live tensor bytes), which differs from this benchmark's
    # outside measure by a few percent: sweep them from memrt's keep-all peak down to its smallest feasible
    # budget, both from its profile; every point is then measured from outside like the baselines
    scale = _memrt_scale(w)
    if scale is not None:
        lo, hi = scale
    memrt_arms, notes = _memrt_arms(w, [int(lo + f * (hi - lo)) for f in fracs])
    skipped += notes
    base = [_new_arm(w, "none", lambda m: _blockwise(w, m, _plain)),
            _new_arm(w, "every_block", lambda m: _blockwise(w, m, _ckpt_every(1))),
            _new_arm(w, "sequential_sqrt", lambda m: _blockwise(w, m, _ckpt_sequential))]
    base += [_new_arm(w, f"every_k={k}", lambda m, k=k: _blockwise(w, m, _ckpt_every(k))) for k in (2, 3)]
    skipped.append(skip_line("save_on_cpu", "needs a GPU: on the CPU the device is the host, so it only copies "
                             "host memory to host memory (benchmarks/gpu_check.sh runs it on CUDA)"))
    if args.quick:
        print("not run in --quick: compile_budget (torch.compile takes ~1 min per budget on 2 cores)", flush=True)
        skipped.append({"arm": "compile_budget", "not_run": "--quick"})
    else:
        for b in args.compile_budgets:
            try:
                torch._dynamo.reset()
                arm = _new_arm(w, f"compile_budget={b}", lambda m: torch.compile(m, backend=budget_backend(b)))
                t0 = time.perf_counter()
                for _ in range(2):
                    _step(w, arm)
                arm.note = f"compile+2 steps {time.perf_counter() - t0:.0f} s"
                base.append(arm)
            except Exception as exc:  # noqa: BLE001 - a baseline that breaks fails the benchmark too
                skipped.append(fail_line(f"compile_budget={b}", f"torch.compile failed: {type(exc).__name__}: {exc}"))
    sac, notes = _sac_arms(w, key, args.quick, [0.5, 0.0] if args.quick else [0.75, 0.5, 0.25, 0.0])
    base += sac
    skipped += notes
    arms = memrt_arms + base
    skipped += _measure(w, arms, args.rounds)
    base = [a for a in base if a in arms]
    arms = base + [a for a in memrt_arms if a in arms]
    t_none = _median(base[0].times_s)
    rows = []
    for a in arms:
        t = _median(a.times_s)
        rows.append({"arm": a.name, "peak_bytes": a.peak_bytes, "step_s": t, "step_samples_s": a.times_s,
                     "time_vs_none": t / t_none, "peak_vs_none": a.peak_bytes / base[0].peak_bytes, "note": a.note,
                     "memrt": a.name.startswith("memrt")})
    _dominance(rows)
    print_table(["arm", "peak", "peak/none", "step ms", "time/none", "covered by / covers", "note"],
                [[r["arm"], format_bytes(r["peak_bytes"]), f"{r['peak_vs_none']:.2f}", f"{r['step_s'] * 1e3:.0f}",
                  fmt_ratio(r["time_vs_none"]), r["dominance"], r["note"]] for r in rows],
                title=f"{key}: {w.name} (baseline: none, same run)")
    eager = [r for r in rows if not r["arm"].startswith("compile_budget")]
    return {"workload": w.name, "rows": rows, "skipped": skipped, "memrt_dominates": _verdict(rows),
            "memrt_dominates_eager": _verdict(eager),
            "not_covered": [r["arm"] for r in rows if not r["memrt"] and not r.get("covered_by_memrt")]}


def _dominance(rows: list[dict]) -> None:
    mem = [r for r in rows if r["memrt"]]
    for r in rows:
        if r["memrt"]:
            fits = [b for b in rows if not b["memrt"] and b["peak_bytes"] <= r["peak_bytes"] * (1 + TOLERANCE)]
            best = min(fits, key=lambda b: b["step_s"]) if fits else None
            r["fastest_baseline_fitting"] = best["arm"] if best else None
            r["time_vs_fastest_fitting"] = r["step_s"] / best["step_s"] if best else None
            r["dominance"] = f"vs {best['arm']}: {fmt_ratio(r['time_vs_fastest_fitting'])}" if best else "no baseline fits"
        else:
            cover = [m for m in mem if m["peak_bytes"] <= r["peak_bytes"] * (1 + TOLERANCE)
                     and m["step_s"] <= r["step_s"] * (1 + TOLERANCE)]
            r["covered_by_memrt"] = cover[0]["arm"] if cover else None
            r["dominance"] = f"covered by {cover[0]['arm']}" if cover else ("NOT covered" if mem else "-")


def _verdict(rows: list[dict]) -> bool | None:
    if not any(r["memrt"] for r in rows):
        return None
    return all(r["covered_by_memrt"] for r in rows if not r["memrt"])


def _plot(results: dict[str, Any]):
    def draw(plt):
        keys = list(results)
        for i, key in enumerate(keys):
            ax = plt.subplot(1, len(keys), i + 1)
            for r in results[key]["rows"]:
                ax.scatter(r["peak_bytes"] / 2**20, r["step_s"] * 1e3, marker="o" if r["memrt"] else "s",
                           color="tab:red" if r["memrt"] else "tab:blue")
                ax.annotate(r["arm"], (r["peak_bytes"] / 2**20, r["step_s"] * 1e3), fontsize=6)
            ax.set_xlabel("peak (MiB)")
            ax.set_ylabel("step time (ms)")
            verdict = results[key]["memrt_dominates"]
            ax.set_title(f"{key}: memrt dominates = {verdict}", fontsize=9)
    return draw


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--workloads", default="gpt,cnn", help="comma list of gpt, cnn (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per arm (default 3 quick, 7 full)")
    p.add_argument("--compile-budgets", default="1.0,0.5,0.1",
                   help="activation_memory_budget values for the torch.compile arm (default: %(default)s; '' = none)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on a shared machine)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.compile_budgets = [float(b) for b in args.compile_budgets.split(",") if b.strip()]
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(machine_line(info), flush=True)
    wls = _workloads(args.quick)
    results = {k: run_workload(k, wls[k], args) for k in args.workloads.split(",")}
    write_json(args.out, "memory_frontier", {"machine": info, "quick": args.quick, "results": results,
                                             "failed": failures()})
    save_plot(args.out, "memory_frontier", _plot(results))
    for k, r in results.items():
        if r["memrt_dominates"] is None:
            print(f"{k}: memrt points dominate: n/a (no memrt arm measured)")
            continue
        print(f"{k}: memrt points dominate every baseline point (<= {1 + TOLERANCE:.2f}x peak and time): "
              f"{r['memrt_dominates']}; every eager baseline (torch.compile arms aside): "
              f"{r['memrt_dominates_eager']}; not covered: {', '.join(r['not_covered']) or 'none'}")
    return exit_code()


if __name__ == "__main__":
    ensure_mmap_threshold()
    sys.exit(main())
