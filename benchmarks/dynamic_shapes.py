"""Input shapes that vary every step: memrt.auto's shape buckets against the same job under one fixed plan.

    python -m benchmarks.dynamic_shapes            # GPT-2 'small' (6x256), batch 8, 120 steps, 3 rounds
    python -m benchmarks.dynamic_shapes --quick    # GPT-2 'tiny' (4x128), batch 4, 24 steps, 1 round

A transformers GPT2LMHeadModel trains on dynamically padded batches (what a padding collator gives:
each step's batch padded to its longest sequence, a new length every step, drawn from the upper three
quarters of the model's context, attention masks and -100 labels on the padding). The budget is midway
between the peak without checkpointing and with transformers' own checkpointing of every layer, both at
the longest batch, measured in this process by memrt's tracker.

- Check pass (not timed): memrt.auto from a fresh state; per step the tracker's peak (must be <= the
  budget at every step), the gradients (must equal stock's bitwise), and the profiling steps (at most
  one per shape bucket).
- Timing: in interleaved rounds, the whole job under memrt.auto from a fresh state (its profiling,
  planning and certification steps included) and the same job with memrt's plan for the largest bucket
  fixed from the start (``memrt.apply``: no profiling, no measurement). Printed: the median job time of
  each and their ratio. Goal: memrt <= 1.05 x the fixed plan. Stock (no memrt, over the budget) is timed
  too, for reference.

Prints PASS or FAIL per goal; a memrt arm that raises fails the benchmark (exit 1).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any, Callable

import torch

from memrt.testing.zoo import padded_batch
from benchmarks._common import (base_parser, exit_code, fail_line, failures, format_bytes, fmt_ratio, machine_info,
                                machine_line, print_table, write_json)

__all__ = ["main"]

TIME_GOAL = 1.05


def _job(model: torch.nn.Module, lengths: list[int], batch: int, vocab: int, *,
         setup: Callable[[torch.nn.Module], None] | None = None, peaks: list[int] | None = None,
         grads: list[list[torch.Tensor]] | None = None) -> float:
    """Train over ``lengths`` (AdamW); returns the wall seconds of the whole job (setup included)."""
    from memrt.memory.meter import known_tensors, watch_optimizers
    from memrt.profiling.cpu_tracker import CpuMemoryTracker

    watch_optimizers()
    batches = [padded_batch(s, n, batch=batch, vocab=vocab) for s, n in enumerate(lengths)]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if setup is not None:
        setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for b in batches:
        opt.zero_grad(set_to_none=True)
        tr = None
        if peaks is not None:
            tr = CpuMemoryTracker().start(known_tensors(model, list(b.values())), scan_gc=False)
        loss = model(**b).loss
        loss.backward()
        if grads is not None:
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        del loss
        if tr is not None:
            tr.stop()
            peaks.append(tr.peak_bytes)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 120; quick 24)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable when shared)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import memrt
    import memrt.memory.auto as auto_mod
    from memrt.memory.buckets import bucket_dim
    from memrt.memory.cache import PlanCache
    from memrt.testing import zoo

    size = "tiny" if args.quick else "small"
    steps = args.steps or (24 if args.quick else 120)
    rounds = args.rounds or (1 if args.quick else 3)
    info = machine_info()
    print(machine_line(info), flush=True)
    case = zoo.build("gpt2", size)
    base = case.model
    cfg = base.config
    context = cfg.n_positions
    batch = case.batch(0)["input_ids"].shape[0]
    g = torch.Generator().manual_seed(7)
    lengths = [int(n) for n in torch.randint(context // 4 + 1, context + 1, (steps,), generator=g)]
    lengths[-1] = context  # the longest batch comes, late
    buckets = sorted({bucket_dim(n) for n in lengths})
    print(f"{case.description.split(',')[0]}, batch {batch}, {steps} steps, lengths {min(lengths)}..{max(lengths)} "
          f"({len(set(lengths))} distinct; buckets {buckets})", flush=True)

    # budget: midway between no checkpointing and transformers' own checkpointing, at the longest batch
    ref_grads: list[list[torch.Tensor]] = []
    stock_peaks: list[int] = []
    _job(copy.deepcopy(base), lengths, batch, cfg.vocab_size, peaks=stock_peaks, grads=ref_grads)
    ckpt_peaks: list[int] = []
    _job(copy.deepcopy(base), [context] * 2, batch, cfg.vocab_size, setup=lambda m: case.checkpoint(m, 1),
         peaks=ckpt_peaks)
    budget = (max(stock_peaks) + max(ckpt_peaks)) // 2
    print(f"peaks at length {context}: none {format_bytes(max(stock_peaks))}, checkpoint every layer "
          f"{format_bytes(max(ckpt_peaks))}; budget {format_bytes(budget)}", flush=True)

    result: dict[str, Any] = {"size": size, "steps": steps, "batch": batch, "lengths": lengths, "buckets": buckets,
                              "budget_bytes": budget}
    # check pass
    profiled: list[str] = []
    begin = auto_mod.ProfileSession.begin

    def counting_begin(self, *a: Any, **k: Any) -> Any:
        profiled.append(self.profile.signature)
        return begin(self, *a, **k)

    cache = PlanCache()
    model = copy.deepcopy(base)
    peaks: list[int] = []
    grads: list[list[torch.Tensor]] = []
    top_plan = None
    try:
        auto_mod.ProfileSession.begin = counting_begin
        _job(model, lengths, batch, cfg.vocab_size, setup=lambda m: memrt.auto(m, budget, offload="none", cache=cache),
             peaks=peaks, grads=grads)
        bucket_of = {e.plan.signature: e.plan for e in cache._mem.values()}
        top_plan = next((pl for sig, pl in bucket_of.items() if f"({batch}, {context})" in sig), None)
        memrt.disable(model)
    except Exception as exc:  # noqa: BLE001 - a raising memrt arm fails the benchmark
        fail_line("memrt check pass", f"{type(exc).__name__}: {exc}")
    finally:
        auto_mod.ProfileSession.begin = begin
    if peaks:
        over = [(s, n, pk) for s, (n, pk) in enumerate(zip(lengths, peaks)) if pk > budget]
        bitwise = len(grads) == len(ref_grads) and all(
            len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(grads, ref_grads))
        profiled_buckets = [bucket_dim(int(sig.split(",")[1].split(")")[0])) for sig in profiled]
        once = len(profiled_buckets) == len(set(profiled_buckets))
        result.update(max_peak_bytes=max(peaks), steps_over_budget=over, bitwise=bitwise,
                      profiled=profiled, cache_entries=len(cache))
        print(f"check: peak <= budget at every step: {'PASS' if not over else 'FAIL'} (highest "
              f"{format_bytes(max(peaks))} of {format_bytes(budget)}); gradients bitwise stock at every step: "
              f"{'PASS' if bitwise else 'FAIL'}; profiling steps {len(profiled)} for {len(buckets)} buckets "
              f"(at most once per bucket: {'PASS' if once else 'FAIL'}); plans cached {len(cache)}", flush=True)
        for what, ok in (("peak over budget", not over), ("gradients differ from stock", bitwise),
                         ("a bucket profiled twice", once)):
            if not ok:
                fail_line("memrt check pass", what)
    grads.clear()  # every step's gradients of both passes (GBs): not kept through the timing rounds
    ref_grads.clear()
    if top_plan is None:
        fail_line("memrt check pass", f"no plan for the bucket of length {context}")
    else:
        print(f"memrt's plan for the largest bucket (fixed arm): "
              f"{', '.join(u.action for u in top_plan.units)}", flush=True)

    # timing rounds
    times: dict[str, list[float]] = {"stock": [], "fixed plan": [], "memrt": []}
    if top_plan is not None and not failures():
        fixed = copy.deepcopy(top_plan)
        fixed.measured_peak_bytes = None
        arms: dict[str, Callable[[torch.nn.Module], None] | None] = {
            "stock": None,
            "fixed plan": lambda m: memrt.apply(m, fixed),
            "memrt": lambda m: memrt.auto(m, budget, offload="none", cache=PlanCache()),
        }
        for r in range(rounds):
            for arm, setup in (arms.items() if r % 2 == 0 else reversed(list(arms.items()))):
                m = copy.deepcopy(base)
                try:
                    times[arm].append(_job(m, lengths, batch, cfg.vocab_size, setup=setup))
                except Exception as exc:  # noqa: BLE001
                    fail_line(arm, f"{type(exc).__name__}: {exc}")
                finally:
                    memrt.disable(m)
    med = {arm: statistics.median(v) for arm, v in times.items() if v}
    ratio = med["memrt"] / med["fixed plan"] if "memrt" in med and "fixed plan" in med else None
    result.update(job_seconds=times, median_job_seconds=med, memrt_vs_fixed=ratio)
    print_table(["arm", "median job s", "vs fixed plan", "fits budget"],
                [[arm, f"{s:.2f}", fmt_ratio(s / med["fixed plan"]) if "fixed plan" in med else "-",
                  "no" if arm == "stock" else "yes"] for arm, s in med.items()],
                title=f"dynamically padded GPT-2 ({size}), {steps} steps, {rounds} round(s), same run")
    if ratio is not None:
        ok = ratio <= TIME_GOAL
        print(f"memrt / fixed plan = {ratio:.3f} (goal <= {TIME_GOAL:.2f}): {'PASS' if ok else 'FAIL'}"
              + ("" if ok or not args.quick else " (quick mode: too few steps to amortise profiling)"), flush=True)
        result["time_goal_met"] = ok
    write_json(args.out, "dynamic_shapes", {"machine": info, "quick": args.quick, "result": result,
                                            "failed": failures()})
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
