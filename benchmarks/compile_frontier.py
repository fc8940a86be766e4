"""Compiled memory frontier: memrt's plans under torch.compile against torch.compile's own memory knobs.

Command (full: several minutes per compiled arm on 2 cores; --quick: one workload, few arms, ~5 min):

    cd /work/main && .venv/bin/python -m benchmarks.compile_frontier [--quick] [--workloads gpt,cnn] [--out DIR]

Arms (same workloads, batch, AdamW step and outside peak measure as benchmarks/memory_frontier.py, whose
helpers this reuses), all compiled by inductor in this one run:

- ``compiled``: ``torch.compile`` of the model, no checkpointing (the baseline ratios are taken against);
- ``compiled+every_block``: ``torch.utils.checkpoint`` (non-reentrant) around every block, compiled;
- ``compile_budget=B``: ``torch._functorch.config.activation_memory_budget = B`` (torch.compile's own
  memory/time frontier);
- ``memrt+compile@B``: ``memrt.auto(model, budget=B, offload="none")`` then ``torch.compile``: memrt's plan
  as checkpointed regions inside the graph, at budgets swept between memrt's keep-all peak and its
  smallest feasible budget.

Workloads: ``gpt`` and ``cnn`` of benchmarks/memory_frontier.py, and ``gpt_nodrop``, the same GPT with
dropout 0 (as LLM pretraining recipes run it): memrt leaves the graph of a forward without random numbers
to torch's partitioner under the ratio its budget gives (memrt.memory.compiled), and plans units otherwise.

Every arm's gradients are checked after the timing: one step from the same initial state and seed, against
compiled stock's. A baseline arm whose gradients differ by more than 1e-3 of their largest magnitude is
reported and not counted among the points memrt must cover: under ``activation_memory_budget`` < 1.0, torch
2.13's partitioner may recompute dropout in the backward with fresh random numbers (wrong gradients,
pytorch/pytorch#190758), so on the ``gpt`` workload the budget arms below 1.0 train a different model. A memrt
arm whose gradients are not compiled stock's bits (with one thread) fails the benchmark.

Output: a table per workload, ``<out>/compile_frontier.json``, and whether every compiled baseline point
with compiled stock's gradients is covered by a memrt point (peak <= 1.02x and time <= 1.02x, same run).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Any

import torch

import benchmarks.memory_frontier as mf
from benchmarks._common import (base_parser, ensure_mmap_threshold, exit_code, fail_line, failures, format_bytes, fmt_ratio,
                                machine_info, machine_line, print_table, write_json)

__all__ = ["main", "compiled_arms"]


def _workloads(quick: bool) -> dict[str, mf.Workload]:
    wls = mf._workloads(quick)
    gpt = wls["gpt"]
    wls["gpt_nodrop"] = dataclasses.replace(gpt, name=gpt.name + ",dropout=0", build=lambda: _no_dropout(gpt.build()))
    return wls


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


GRAD_SEED = 1234
"""Seed of the gradient check's step (the same for every arm)."""


def _gradients(w: mf.Workload, arm: mf.Arm, initial: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of one step of ``arm`` (its plan, its compiled code) from the state ``initial``."""
    with torch.no_grad():
        arm.model.load_state_dict(initial)
    arm.opt.zero_grad(set_to_none=True)
    torch.manual_seed(GRAD_SEED)
    x, y = w.batch
    w.loss(arm.forward(x), y).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in arm.model.parameters()]
    arm.opt.zero_grad(set_to_none=True)
    return grads


GRAD_TOLERANCE = 1e-3
"""A baseline arm trains another model where its gradients differ from compiled stock's by more than this
fraction of their largest magnitude (rounding of another fusion stays far below it)."""


def _compare(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether ``grads`` equal ``ref`` bit for bit, and the largest difference relative to ``ref``'s largest
    magnitude."""
    equal = len(grads) == len(ref) and all(torch.equal(a, b) for a, b in zip(grads, ref))
    diff = max(((a - b).abs().max().item() for a, b in zip(grads, ref)), default=0.0)
    scale = max((r.abs().max().item() for r in ref), default=0.0)
    return equal, diff / scale if scale > 0 else diff


def _compiled_arm(w: mf.Workload, name: str, run_blocks: Any) -> mf.Arm:
    torch._dynamo.reset()
    return mf._new_arm(w, name, lambda m: torch.compile(mf._blockwise(w, m, run_blocks)))


MAX_WARM_STEPS = 16
"""Steps a memrt arm may take to certify its plan: profile, then per plan tried one step that recompiles
(not measured) and one measured step, certified when the next one begins; up to two partitioner plans, three
units' plans and the floor."""


def _warm(w: mf.Workload, arm: mf.Arm, steps: int, *, until_certified: bool = False) -> None:
    """``steps`` steps (compile and warm up); ``until_certified`` (memrt's arms): then on until memrt's plan has
    a measured peak, and one more step, which certifies it, so that no re-plan falls into the timed steps."""
    import memrt

    t0 = time.perf_counter()
    done = 0
    while done < MAX_WARM_STEPS:
        mf._step(w, arm)
        done += 1
        if done < steps:
            continue
        if not until_certified:
            break
        plan = memrt.plan_of(arm.model)
        if plan is not None and plan.measured_peak_bytes is not None:
            mf._step(w, arm)
            done += 1
            break
    arm.note = (arm.note + "; " if arm.note else "") + f"compile+{done} steps {time.perf_counter() - t0:.0f} s"


def compiled_arms(w: mf.Workload, *, memrt_budgets: list[int], compile_budgets: list[float]) -> tuple[list[mf.Arm], list[dict]]:
    """Every compiled arm of workload ``w`` (warmed: compiled, memrt planned and certified); notes of failures.

    memrt's arms come first and are made while no baseline model is alive (memrt's CPU budget counts every
    live CPU tensor of the process). The caller measures them with ``memory_frontier._measure``.
    """
    import memrt

    arms: list[mf.Arm] = []
    notes: list[dict] = []
    todo, tried = list(memrt_budgets), set()
    while todo:
        b = todo.pop(0)
        tried.add(b)
        name = f"memrt+compile@{format_bytes(b)}"
        try:
            torch._dynamo.reset()
            arm = mf._new_arm(w, name, lambda m: m)
            memrt.auto(arm.model, budget=int(b), offload="none")
            arm.forward = torch.compile(arm.model)
            _warm(w, arm, 4, until_certified=True)
            plan = memrt.plan_of(arm.model)
            if plan is not None:
                kinds = sorted({u.action for u in plan.units})
                arm.note = f"{sum(u.action != 'keep' for u in plan.units)} of {len(plan.units)} recomputed " \
                           f"({', '.join(kinds)}); certified {format_bytes(plan.measured_peak_bytes)}; " + arm.note
            arms.append(arm)
        except memrt.BudgetError as exc:  # the compiled step measured over: memrt names the budget that fits
            least = exc.min_feasible_bytes
            if least is None or least <= b:
                notes.append(fail_line(name, f"BudgetError: {str(exc)[:300]}"))
            else:
                print(f"note {name}: infeasible compiled, smallest feasible {format_bytes(least)}; measuring that",
                      flush=True)
                notes.append({"arm": name, "infeasible": str(exc)[:300]})
                if least not in tried and least not in todo:
                    todo.append(int(least))
        except Exception as exc:  # noqa: BLE001 - reported, fails the benchmark
            notes.append(fail_line(name, f"{type(exc).__name__}: {str(exc)[:300]}"))
    for name, run_blocks in (("compiled", mf._plain), ("compiled+every_block", mf._ckpt_every(1))):
        try:
            arm = _compiled_arm(w, name, run_blocks)
            _warm(w, arm, 2)
            arms.append(arm)
        except Exception as exc:  # noqa: BLE001
            notes.append(fail_line(name, f"{type(exc).__name__}: {str(exc)[:300]}"))
    for b in compile_budgets:
        name = f"compile_budget={b}"
        try:
            torch._dynamo.reset()
            arm = mf._new_arm(w, name, lambda m: torch.compile(m, backend=mf.budget_backend(b)))
            _warm(w, arm, 2)
            arms.append(arm)
        except Exception as exc:  # noqa: BLE001
            notes.append(fail_line(name, f"{type(exc).__name__}: {str(exc)[:300]}"))
    return arms, notes


def run_workload(key: str, w: mf.Workload, args: Any) -> dict[str, Any]:
    print(f"\n=== {key} (compiled): {w.name} ===", flush=True)
    scale = mf._memrt_scale(w)
    if scale is None:
        return {"workload": w.name, "rows": [], "skipped": [fail_line("memrt", "no memrt scale")]}
    lo, hi = scale
    fracs = [1.0, 0.0] if args.quick else [1.0, 0.5, 0.25, 0.1, 0.0]
    gc.collect()
    arms, notes = compiled_arms(w, memrt_budgets=[int(lo + f * (hi - lo)) for f in fracs],
                                compile_budgets=args.compile_budgets)
    notes += mf._measure(w, arms, args.rounds)
    torch.manual_seed(0)  # the arms' initial state (memory_frontier._new_arm seeds the same way)
    initial = {k: v.detach().clone() for k, v in w.build().state_dict().items()}
    base = [a for a in arms if not a.name.startswith("memrt")]
    if not base or not base[0].times_s:
        return {"workload": w.name, "rows": [], "skipped": notes}
    ref = next((a for a in base if a.name == "compiled"), base[0])
    t_ref = mf._median(ref.times_s)
    ordered = base + [a for a in arms if a.name.startswith("memrt")]
    grads = {a.name: _gradients(w, a, initial) for a in ordered}
    rows = []
    for a in ordered:
        t = mf._median(a.times_s)
        equal, diff = _compare(grads[a.name], grads[ref.name])
        rows.append({"arm": a.name, "peak_bytes": a.peak_bytes, "step_s": t, "step_samples_s": a.times_s,
                     "time_vs_compiled": t / t_ref, "peak_vs_compiled": a.peak_bytes / ref.peak_bytes, "note": a.note,
                     "memrt": a.name.startswith("memrt"), "grads_equal": equal, "grads_rel_diff": diff,
                     "counted": a.name.startswith("memrt") or diff <= GRAD_TOLERANCE})
        # memrt's promise is the same bits (one thread: inductor's split reductions are not reproducible)
        if a.name.startswith("memrt") and not (equal or (args.threads > 1 and diff <= GRAD_TOLERANCE)):
            notes.append(fail_line(a.name, f"gradients differ from compiled stock's ({diff:.3g} of their largest)"))
    mf._dominance([r for r in rows if r["counted"]])
    for r in rows:
        if not r["counted"]:
            r["covered_by_memrt"] = None
            r["dominance"] = "not counted: gradients differ"
    print_table(["arm", "peak", "peak/compiled", "step ms", "time/compiled", "grads vs compiled", "covered by / covers",
                 "note"],
                [[r["arm"], format_bytes(r["peak_bytes"]), f"{r['peak_vs_compiled']:.2f}", f"{r['step_s'] * 1e3:.0f}",
                  fmt_ratio(r["time_vs_compiled"]),
                  "bitwise" if r["grads_equal"] else f"differ {r['grads_rel_diff']:.2g} of max",
                  r["dominance"], r["note"]] for r in rows],
                title=f"{key}: {w.name} compiled (baseline: compiled, same run)")
    counted = [r for r in rows if r["counted"]]
    return {"workload": w.name, "rows": rows, "skipped": notes, "memrt_dominates": mf._verdict(counted),
            "not_covered": [r["arm"] for r in counted if not r["memrt"] and not r.get("covered_by_memrt")],
            "not_counted": [r["arm"] for r in rows if not r["counted"]]}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--workloads", default="gpt,gpt_nodrop,cnn",
                   help="comma list of gpt, gpt_nodrop, cnn (default: %(default)s; --quick: gpt_nodrop)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per arm (default 2 quick, 7 full)")
    p.add_argument("--compile-budgets", default=None,
                   help="activation_memory_budget values (default 1.0,0.5,0.1; --quick 0.5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    budgets = args.compile_budgets or ("0.5" if args.quick else "1.0,0.5,0.1")
    args.compile_budgets = [float(b) for b in budgets.split(",") if b.strip()]
    workloads = "gpt_nodrop" if args.quick and args.workloads == "gpt,gpt_nodrop,cnn" else args.workloads
    torch.set_num_threads(args.threads)
    # Every arm's model is of the workload's class, all alive at once: dynamo keeps one compiled entry per plan and
    # arm for the class's forward, more than its default limit of 8 (past it, a forward runs eagerly). A job holds
    # one model.
    torch._dynamo.config.recompile_limit = 64
    info = machine_info()
    print(machine_line(info), flush=True)
    wls = _workloads(args.quick)
    results = {k: run_workload(k, wls[k], args) for k in workloads.split(",")}
    write_json(args.out, "compile_frontier", {"machine": info, "quick": args.quick, "results": results,
                                              "failed": failures()})
    for k, r in results.items():
        print(f"{k}: memrt's compiled points cover every compiled baseline point with compiled stock's gradients "
              f"(<= {1 + mf.TOLERANCE:.2f}x peak and time): {r.get('memrt_dominates')}; not covered: "
              f"{', '.join(r.get('not_covered', [])) or 'none'}; not counted (gradients differ): "
              f"{', '.join(r.get('not_counted', [])) or 'none'}")
    return exit_code()


if __name__ == "__main__":
    ensure_mmap_threshold()
    sys.exit(main())
