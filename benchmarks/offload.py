"""Offload benchmark: a GPT-style model on CPU trained below the peak of "checkpoint every block".

Command (full ~3-5 min on 2 loaded cores; --quick < 60 s):

    cd /work/main && .venv/bin/python -m benchmarks.offload [--quick] [--out DIR] [--device cpu|cuda] [--tier disk|host]

Arms, all in this one run with the same model init, batch and AdamW step:

- ``every_block`` (the baseline of every ratio): ``torch.utils.checkpoint`` (non-reentrant) around each block;
- ``memrt.plan@75%``: ``memrt.profile`` -> ``memrt.plan(profile, budget, offload=tier)`` -> ``memrt.apply``
  with budget = 75% of the baseline's measured peak (the planner chooses per block among keep,
  recompute, offload and recompute+offload);
- ``recompute+offload (all)``: ``memrt.memory.offload.offload_units(..., recompute=True)``, the lower path;
- ``memrt.auto@75%`` (full run only): ``memrt.auto(model, budget)`` from a fresh model;
- ``none`` (full run only): no checkpointing, peak only (it does not fit any of these budgets).

Peak: the project's CPU tracker (``memrt.profiling.cpu_tracker``), live tensor bytes on the device during
one training step, measured with only that arm's model alive (phase 1); step times come from phase 2,
where all arms are rebuilt and alternate round by round. On CUDA: ``torch.cuda.max_memory_allocated`` per step. Step time: median over
rounds that interleave the arms. Prints the offload engine's stats (bytes moved, I/O time, time the
training thread waited) and, on CUDA, the share of copy time hidden behind compute.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from benchmarks._common import base_parser, format_bytes, fmt_ratio, machine_info, machine_line, print_table, write_json
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

SHARE = 0.75


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class Arm:
    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.name, self.model, self.x, self.y = name, model, x, y
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.peak: int | None = None
        self.times: list[float] = []
        self.note = ""
        self.engine_stats: Any = None
        self.closer: Callable[[], None] | None = None
        self.plan: Any = None
        self.kind = name

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.model(self.x), self.y).backward()
        self.opt.step()

    def static(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + list(self.model.buffers())
        out += [p.grad for p in self.model.parameters() if p.grad is not None]
        out += [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return out


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def measure_peak(arm: Arm, others: list[Arm], device: torch.device) -> int:
    """Peak live device bytes of one step of ``arm`` (static bytes of ``others`` subtracted)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        arm.step()
        torch.cuda.synchronize()
        other = _storage_bytes([t for o in others for t in o.static()])
        return torch.cuda.max_memory_allocated(device) - other + 0 * base
    from memrt.profiling.cpu_tracker import CpuMemoryTracker

    other = _storage_bytes([t for o in others for t in o.static()])
    tracker = CpuMemoryTracker()
    tracker.start(extra=arm.static() + [arm.x, arm.y])
    try:
        arm.step()
    finally:
        tracker.stop()
    return tracker.peak_bytes - other


def _build(kind: str, cfg: GPTConfig, device: torch.device, x, y, tier: str, budget: int | None,
           plan: Any = None) -> Arm:
    """A fresh arm of ``kind`` (same seed, same init); memrt arms are ready to train (plan in force)."""
    import memrt

    torch.manual_seed(0)
    m = GPT(cfg).to(device)
    if kind == "every_block":
        m.blocks = nn.ModuleList(_Checkpointed(b) for b in m.blocks)
        return Arm(kind, m, x, y)
    if kind == "none":
        return Arm(kind, m, x, y)
    if kind == "plan":
        arm = Arm(f"memrt.plan@{SHARE:.0%}", m, x, y)
        if plan is None:
            arm.step()  # optimizer state exists before profiling, as in a running job
            prof = memrt.profile(m, arm.step)
            plan = memrt.plan(prof, budget, offload=tier)
        memrt.apply(m, plan)
        arm.plan = plan
        acts = sorted({u.action for u in plan.units})
        arm.note = (f"(plan: {', '.join(f'{a} x{sum(u.action == a for u in plan.units)}' for a in acts)}; "
                    f"predicted {format_bytes(plan.predicted_peak_bytes)})")
        arm.closer = lambda: memrt.disable(m)
        return arm
    if kind == "lower":
        from memrt.memory.offload import offload_units

        handle = offload_units(m, list(m.blocks), tier, recompute=True)
        arm = Arm("recompute+offload (all)", m, x, y)
        arm.handle = handle
        arm.closer = handle.close
        return arm
    if kind == "auto":
        arm = Arm(f"memrt.auto@{SHARE:.0%}", m, x, y)
        memrt.auto(m, budget=budget, offload=tier)
        arm.closer = lambda: memrt.disable(m)
        return arm
    raise ValueError(kind)


def _engines(arm: Arm) -> list:
    h = getattr(arm, "handle", None)
    if h is not None:
        return [h.engine]
    from memrt.memory import apply as apply_mod

    ah = getattr(apply_mod, "_HANDLES", {}).get(arm.model)
    if ah is None:
        from memrt.memory import auto as auto_mod

        st = getattr(auto_mod, "_STATES", {}).get(arm.model)
        ah = getattr(st, "handle", None)
    return list(ah.context.engines.values()) if ah is not None else []


def cuda_overlap(cfg: GPTConfig, batch: int, rounds: int) -> dict[str, Any]:
    """Host tier on CUDA: share of copy time hidden behind compute, pinned allocations, parameter equality.

    exposed = median step(offload_host, every block) - median step(no offload); copy = device time of all
    offload copies of a step (CUDA events on the copy stream); hidden = 1 - exposed / copy.
    """
    from memrt.memory.offload import offload_units

    x, y = gpt_batch(cfg, batch, device="cuda")
    torch.manual_seed(0)
    keep = Arm("keep", GPT(cfg).cuda(), x, y)
    torch.manual_seed(0)
    m = GPT(cfg).cuda()
    handle = offload_units(m, list(m.blocks), "host")
    off = Arm("offload_host (all)", m, x, y)
    tier = handle.engine._tier
    t_keep, t_off, copies = [], [], []
    allocs = []
    for r in range(rounds + 2):
        for arm, times in ((keep, t_keep), (off, t_off)):
            torch.manual_seed(100 + r)  # same dropout masks in both arms
            tier.time_copies = arm is off and r >= 2
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            arm.step()
            torch.cuda.synchronize()
            if r >= 2:
                times.append(time.perf_counter() - t0)
        if r >= 2:
            copies.append(tier.copy_seconds())
        tier.time_copies = False
        allocs.append(handle.stats().pinned_allocations)
    max_diff = max((a - b).abs().max().item() for a, b in zip(keep.model.parameters(), off.model.parameters()))
    exposed = max(0.0, statistics.median(t_off) - statistics.median(t_keep))
    copy_s = statistics.median(copies)
    hidden = 1.0 - exposed / copy_s if copy_s > 0 else float("nan")
    s = handle.stats()
    handle.close()
    out = {"step_keep_s": statistics.median(t_keep), "step_offload_host_s": statistics.median(t_off),
           "copy_seconds_per_step": copy_s, "exposed_seconds": exposed, "hidden_share": hidden,
           "pinned_allocations_per_step": allocs, "params_max_abs_diff": max_diff,
           "host_peak_bytes": s.host_peak_bytes, "host_pool_capacity_bytes": s.host_pool_capacity_bytes}
    print(f"CUDA host tier: step keep {out['step_keep_s']:.4f} s, offload_host {out['step_offload_host_s']:.4f} s, "
          f"copies {copy_s:.4f} s/step, hidden {hidden:.0%} (goal >= 70%); pinned allocations after each step "
          f"{allocs} (goal: constant from step 2); params after {rounds + 2} steps max |diff| {max_diff:g} "
          f"(0 = bitwise equal)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import gc

    import memrt

    p = base_parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tier", default=None, help="disk (default on CPU) or host (default on CUDA)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 3 quick, 7 full)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tier = args.tier or ("host" if device.type == "cuda" else "disk")
    rounds = args.rounds or (3 if args.quick else 7)
    if device.type == "cpu":
        torch.set_num_threads(1)  # steady timings on a shared machine; the I/O thread gets the other core
    info = machine_info()
    print(machine_line(info), flush=True)
    if device.type == "cuda":
        cfg, batch = GPTConfig(n_layer=24, d_model=512, seq_len=1024, n_head=8, vocab_size=256), 8
    elif args.quick:
        cfg, batch = GPTConfig(n_layer=24, d_model=32, seq_len=64, n_head=1, vocab_size=256), 32
    else:
        cfg, batch = GPTConfig(n_layer=24, d_model=64, seq_len=128, n_head=2, vocab_size=256), 32
    print(f"# model: GPT n_layer={cfg.n_layer} d_model={cfg.d_model} seq_len={cfg.seq_len} n_head={cfg.n_head} "
          f"batch={batch}, AdamW, {device}, tier={tier}, threads={torch.get_num_threads()}", flush=True)
    x, y = gpt_batch(cfg, batch, device=device)
    t_start = time.perf_counter()

    # phase 1: peaks, one arm alive at a time (the tracker counts every live tensor of the process)
    kinds = ["every_block", "lower", "plan"] + ([] if args.quick else ["auto", "none"])
    peaks: dict[str, int] = {}
    notes: dict[str, str] = {}
    names: dict[str, str] = {}
    budget = None
    plan = None
    for kind in kinds:
        gc.collect()
        # tensors left alive by an earlier arm (none expected) are not this arm's: subtract them
        with warnings.catch_warnings():  # isinstance on every gc object trips deprecation warnings
            warnings.simplefilter("ignore")
            leftover = 0 if device.type == "cuda" else _storage_bytes(
                [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o is not x and o is not y])
        try:
            arm = _build(kind, cfg, device, x, y, tier, budget)
        except memrt.BudgetError as exc:
            print(f"{kind}: {exc}", flush=True)
            continue
        for _ in range(3 if kind == "auto" else 1):  # auto: profile, plan + certify, then in force
            arm.step()
        peaks[kind] = measure_peak(arm, [], device) - leftover
        if leftover:
            print(f"# {kind}: {format_bytes(leftover)} of tensors left alive by earlier arms subtracted", flush=True)
        notes[kind], names[kind] = arm.note, arm.name
        if kind == "plan":
            plan = arm.plan
            print(plan, flush=True)
        if kind == "auto":
            pl = memrt.plan_of(arm.model)
            notes[kind] = f"(memrt measured {format_bytes(pl.measured_peak_bytes) if pl else '-'})"
        print(f"{arm.name}: peak {format_bytes(peaks[kind])} {notes[kind]}", flush=True)
        if kind == "every_block":
            budget = int(SHARE * peaks[kind])
            print(f"budget = {SHARE:.0%} of every_block = {format_bytes(budget)}", flush=True)
        if arm.closer is not None:
            arm.closer()
        del arm
        gc.collect()

    # phase 2: step times, arms interleaved round by round
    arms = []
    for kind in kinds:
        if kind in peaks and kind != "none":
            arm = _build(kind, cfg, device, x, y, tier, budget, plan=plan)
            for _ in range(3 if kind == "auto" else 1):
                arm.step()
            arm.peak, arm.kind = peaks[kind], kind
            arms.append(arm)
    for _ in range(rounds):
        for arm in arms:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            arm.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            arm.times.append(time.perf_counter() - t0)
    ck_peak = peaks["every_block"]
    t_ck = statistics.median(arms[0].times)
    rows, results = [], []
    for kind in kinds:
        if kind not in peaks:
            continue
        arm = next((a for a in arms if a.kind == kind), None)
        t = statistics.median(arm.times) if arm is not None else None
        fits = peaks[kind] <= budget
        rows.append([names[kind], format_bytes(peaks[kind]), f"{peaks[kind] / ck_peak:.2f}", "yes" if fits else "no",
                     "-" if t is None else f"{t:.3f}", "-" if t is None else fmt_ratio(t / t_ck)])
        results.append({"arm": names[kind], "peak_bytes": peaks[kind], "peak_vs_every_block": peaks[kind] / ck_peak,
                        "fits_budget": fits, "step_seconds_median": t, "step_seconds": arm.times if arm else [],
                        "time_vs_every_block": None if t is None else t / t_ck, "note": notes[kind]})
    print_table(["arm", "peak", "peak / every_block", f"<= budget ({format_bytes(budget)})", "step s (median)",
                 "time / every_block"], rows, title=f"GPT on {device}: offload to {tier} vs checkpoint every block")
    engines = []
    for arm in arms:
        for e in _engines(arm):
            s = e.stats()
            engines.append({"arm": arm.name, **{k: getattr(s, k) for k in s.__slots__}})
            print(f"{arm.name}: engine {s.tier}: moved {format_bytes(s.bytes_offloaded)}, restored "
                  f"{format_bytes(s.bytes_restored)}, write {s.write_seconds:.3f} s, read {s.read_seconds:.3f} s, "
                  f"waited {s.wait_seconds:.3f} s, disk peak {format_bytes(s.disk_peak_bytes)}, host peak "
                  f"{format_bytes(s.host_peak_bytes)}, pinned allocations {s.pinned_allocations}", flush=True)
    best = min((r for r in results if r["arm"] != "every_block" and r["fits_budget"] and r["step_seconds_median"]),
               key=lambda r: r["step_seconds_median"], default=None)
    if best is None:
        print(f"RESULT: no memrt arm trained under {SHARE:.0%} of every_block", flush=True)
    else:
        print(f"RESULT: {best['arm']} trains at {format_bytes(best['peak_bytes'])} = "
              f"{1 - best['peak_vs_every_block']:.1%} below every_block's peak, step time "
              f"{best['time_vs_every_block']:.2f}x every_block (goal <= 1.3x)", flush=True)
    overlap = cuda_overlap(cfg, batch, rounds) if device.type == "cuda" and tier == "host" else None
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    write_json(args.out, "offload", {"machine": info, "cuda_overlap": overlap, "budget_bytes": budget, "share": SHARE,
                                     "every_block_peak_bytes": ck_peak, "results": results, "engines": engines,
                                     "config": {"n_layer": cfg.n_layer, "d_model": cfg.d_model,
                                                "seq_len": cfg.seq_len, "batch": batch, "tier": tier}})
    for arm in arms:
        if arm.closer is not None:
            arm.closer()
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
