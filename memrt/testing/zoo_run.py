"""Train a zoo model (:mod:`memrt.testing.zoo`) under several arms and measure each from outside.

``python -m memrt.testing.zoo_run --model gpt2 --size tiny --out r.json``

Arms: ``none`` (stock), ``ckpt1`` / ``ckpt2`` (the model's own checkpointing of every / every second
layer) and ``memrt`` at budgets placed between ``ckpt1`` and ``none``: ``budget = ckpt1 + f * (none -
ckpt1)`` for each fraction ``f``, both ends measured here the same way. Each arm builds the model from
the same seed, trains ``--steps`` AdamW steps with the same dropout seed and reports:

- ``outside_peak_bytes``: the process's peak RSS growth over the arm (the kernel's high-water mark
  ``VmHWM``, what ``ru_maxrss`` reports in a fresh process, reset before the arm through
  ``/proc/self/clear_refs``, minus the RSS then; ``ru_maxrss`` itself cannot be used after a reset: it
  also keeps the RSS the process had at fork, a big parent's), with the model built inside the arm, so
  it counts what the budget counts (parameters, gradients, optimizer state, inputs, activations) plus
  whatever else the arm's code holds. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` (the parent sets it)
  so freed large blocks leave RSS at once.
- ``state_sha256`` and ``state_keys`` of the ``state_dict`` after the last step (bitwise comparison).
- ``step_seconds`` per step, and memrt's plan.

A warm-up runs first (one stock step, then two memrt steps at the middle budget), so one-time costs of
the process (kernel libraries' workspaces, modules imported on first use, memrt's I/O thread) are in
every arm's baseline alike; the offload bandwidth figures come from the cache the environment points at
(``XDG_CACHE_HOME``), probed during the warm-up when it is empty.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["run_arm", "main", "peak_reset", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident memory since start or :func:`peak_reset` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the outside peak needs Linux")


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_reset() -> int:
    """Reset the process's peak RSS to its current RSS (Linux ``clear_refs`` 5); returns that RSS."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        raise RuntimeError(f"cannot reset the peak RSS through /proc/self/clear_refs ({exc}); the outside "
                           "peak needs Linux >= 4.0 with a writable /proc") from exc
    return _rss_bytes()


def _state_digest(model: Any) -> tuple[str, list[str]]:
    h = hashlib.sha256()
    state = model.state_dict()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest(), list(state)


def run_arm(name: str, size: str, arm: str, *, steps: int, budget: int | None = None,
            keep: bool = False) -> dict[str, Any]:
    """One arm from a fresh model; ``keep``: also return the model and optimizer (timing rounds)."""
    import torch

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.zoo import build

    base = peak_reset()
    case = build(name, size, seed=0)
    model = case.model
    if arm.startswith("ckpt"):
        case.checkpoint(model, int(arm[4:]))
    elif arm == "memrt":
        memrt.auto(model, budget, cache=PlanCache())
    elif arm != "none":
        raise ValueError(f"unknown arm {arm!r}: expected none, ckpt1, ckpt2 or memrt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1234)  # the dropout / stochastic depth stream, the same in every arm
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model, s)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        del loss
    peak = peak_rss_bytes() - base
    sha, keys = _state_digest(model)
    plan = memrt.plan_of(model) if arm == "memrt" else None
    out: dict[str, Any] = {
        "arm": arm, "budget_bytes": budget, "outside_peak_bytes": int(peak), "state_sha256": sha,
        "state_keys": keys, "step_seconds": times,
        "plan": None if plan is None else {"actions": [u.action for u in plan.units],
                                           "predicted_peak_bytes": plan.predicted_peak_bytes,
                                           "keep_all_peak_bytes": plan.keep_all_peak_bytes,
                                           "measured_peak_bytes": plan.measured_peak_bytes},
        "description": case.description,
    }
    if keep:
        out["_live"] = (case, model, opt)
    else:
        if arm == "memrt":
            memrt.disable(model)
        del case, model, opt
        gc.collect()
    return out


def time_arms(name: str, size: str, arms: list[tuple[str, str, int | None]], *, rounds: int,
              steps: int) -> dict[str, float]:
    """Median step seconds of each ``(label, arm, budget)``, all built first and timed in interleaved rounds
    (``steps`` steps per arm per round), so drift on a shared machine hits every arm alike. memrt's arms
    are warmed up first (profile, plan, certify) while no other model is alive."""
    live: dict[str, tuple] = {}
    order = sorted(arms, key=lambda a: a[1] != "memrt")
    for label, arm, budget in order:
        live[label] = run_arm(name, size, arm, steps=3, budget=budget, keep=True)["_live"]
    times: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    step = 3
    for _ in range(rounds):
        for label, _, _ in arms:
            case, model, opt = live[label]
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                case.loss(model, step).backward()
                opt.step()
                times[label].append(time.perf_counter() - t0)
        step += 1
    return {label: sorted(v)[len(v) // 2] for label, v in times.items()}


def budgets_between(low: int, high: int, fractions: list[float]) -> list[int]:
    return [int(low + f * (high - low)) for f in fractions]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memrt.testing.zoo_run")
    p.add_argument("--model", required=True)
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fractions", default=None,
                   help="memrt budgets between the model's own checkpointing (0) and none (1); default: "
                        "memrt.testing.zoo.budget_fractions (0.25,0.5,0.75)")
    p.add_argument("--refs", default="none,ckpt1", help="reference arms to run (none and ckpt1 are needed)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-rounds", type=int, default=0, help="interleaved timing rounds of every arm (0: none)")
    p.add_argument("--time-steps", type=int, default=2, help="steps per arm per timing round")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    import memrt

    torch.set_num_threads(args.threads)
    import memrt.memory.offload  # noqa: F401 - imported before any baseline: module code is no arm's memory
    import memrt.memory.planner  # noqa: F401

    warm = run_arm(args.model, args.size, "none", steps=1)
    try:  # what memrt sets up once per process (imports, I/O thread, the probe of an empty cache)
        run_arm(args.model, args.size, "memrt", steps=2, budget=int(0.75 * warm["outside_peak_bytes"]))
    except memrt.BudgetError:  # infeasible for this model: the warm-up has done its part regardless
        gc.collect()
    refs = [a for a in args.refs.split(",") if a]
    if "none" not in refs or "ckpt1" not in refs:
        raise SystemExit("--refs must include none and ckpt1 (the budgets lie between them)")
    results = [run_arm(args.model, args.size, a, steps=args.steps) for a in refs]
    by = {r["arm"]: r for r in results}
    from memrt.testing.zoo import budget_fractions

    fractions = ([float(f) for f in args.fractions.split(",") if f] if args.fractions
                 else list(budget_fractions(args.model)))
    budgets = budgets_between(by["ckpt1"]["outside_peak_bytes"], by["none"]["outside_peak_bytes"], fractions)
    for f, b in zip(fractions, budgets):
        try:
            r = run_arm(args.model, args.size, "memrt", steps=args.steps, budget=b)
        except Exception as exc:  # noqa: BLE001 - reported as this arm's failure, the parent decides
            r = {"arm": "memrt", "budget_bytes": b, "error": f"{type(exc).__name__}: {exc}"}
        r["fraction"] = f
        results.append(r)
    timing = None
    if args.time_rounds > 0:
        arms = [(a, a, None) for a in refs] + [(f"memrt@{f}", "memrt", b) for f, b in zip(fractions, budgets)
                                                if "error" not in next(r for r in results if r.get("fraction") == f)]
        timing = time_arms(args.model, args.size, arms, rounds=args.time_rounds, steps=args.time_steps)
    Path(args.out).write_text(json.dumps({"model": args.model, "size": args.size, "steps": args.steps,
                                          "threads": args.threads, "arms": results, "median_step_seconds": timing},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
