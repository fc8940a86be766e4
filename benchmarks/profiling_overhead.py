"""Profiling overhead: a GPT-style training step with memrt's profiling on vs off, same process.

Command (full ~3 min on 2 idle cores, 5 min at load 20; --quick < 60 s):

    cd /work/main && .venv/bin/python -m benchmarks.profiling_overhead [--quick] [--out DIR]

The step: ``memrt.testing.models.GPT`` (default GPTConfig: 4 blocks, d_model 128, seq 128), batch 4,
forward + loss + backward + a flat gradient all-reduce (gloo, world of 1: a real collective call)
+ AdamW. Arms, interleaved in rounds (the order rotates each round) so the machine's load hits all alike:

- ``off``: the baseline. Recorder disabled, no hooks: the stock step.
- ``on``: default profiling settings. Recorder on; a ``UnitMarker`` on every block (forward and backward
  begin/end: memory events + ``memrt::`` trace ranges), ``memrt_range`` around the optimizer step,
  the all-reduce timed by ``comm_log.timed`` (default timing mode: no synchronize), and a ``step``
  bracket. The live-bytes read is an attribute read of a counter (what ``torch.cuda.memory_allocated``
  costs on CUDA); the CPU tracker that would produce that counter on CPU has its own cost, shown by:
- ``off again``: the baseline a second time (not in --quick): its ratio to ``off`` is the noise floor.
- ``on+cpu_tracker``: as ``on`` with ``CpuMemoryTracker`` watching every operator (informational: the
  tracker is the memory planner's meter, not a profiling default).

Printed per arm: median wall and CPU time (``time.thread_time`` of the main thread, where all the
step's compute runs with 1 intra-op thread) per step, and the ratio arm/off of each round (median, min,
max over rounds). CPU time is the steadier measure on a shared machine: waiting for a core inflates wall
time but not the work done. Target: ``on`` <= 1.03x on both.
``--device cuda`` (the GPU check) uses nccl, CUDA-event timing read lazily, ``memory_allocated`` as live
bytes, and adds ``on+exact_timing`` (a device synchronize around each timed collective) to show its cost.
--quick runs off/on only (10 rounds); the full run adds the tracker arm (40 rounds).
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks._common import base_parser, machine_info, machine_line, print_table, write_json
from memrt.profiling import UnitMarker, get_recorder, memrt_range, timed
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss


class _Counter:
    live_bytes = 0


def _step(model, opt, x, y, marker, flat_grads):
    def body():
        loss = lm_loss(model(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if marker is not None:
            with timed("all_reduce", flat, None, "flat", redop="sum"):
                dist.all_reduce(flat)
            with memrt_range("optimizer.step"):
                opt.step()
        else:
            dist.all_reduce(flat)
            opt.step()
        opt.zero_grad(set_to_none=True)

    if marker is None:
        body()
    else:
        with marker.step():
            body()


def replay_seconds(units: list[str], repeats: int) -> float:
    """Seconds of the profiling calls one ``on`` step makes, replayed without the model (hooks' bodies,
    records, ranges, a timed no-op collective): the work profiling adds, free of the step's noise."""
    import torch.nn as nn

    rec = get_recorder()
    rec.configure(enabled=True)
    marker = UnitMarker([(n, nn.Identity()) for n in units], live_bytes=lambda: _Counter.live_bytes, backward=False)
    flat = torch.zeros(4)
    best = float("inf")
    for _ in range(5):
        rec.clear()
        t0 = time.perf_counter()
        for _ in range(repeats):
            with marker.step():
                for phase in ("forward", "backward"):
                    for n in units if phase == "forward" else reversed(units):
                        marker.begin(n, phase)
                        marker.end(n, phase)
                with timed("all_reduce", flat, None, "flat", redop="sum", group_size=1):
                    pass
                with memrt_range("optimizer.step"):
                    pass
        best = min(best, (time.perf_counter() - t0) / repeats)
    marker.remove()
    rec.clear()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=None, help="steps per arm per round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda: nccl, CUDA-event timing, "
                        "memory_allocated live bytes, and an on+exact_timing arm)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default: %(default)s)")
    parser.add_argument("--no-tracker-arm", action="store_true", help="skip the on+cpu_tracker arm (always off in --quick)")
    args = parser.parse_args(argv)
    steps = args.steps or 2
    rounds = args.rounds or (10 if args.quick else 40)
    torch.set_num_threads(1)
    info = machine_info()
    print(machine_line(info), flush=True)

    store = dist.HashStore()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = gpt_batch(cfg, args.batch, device=device)
    rec = get_recorder()
    counter = _Counter()

    def arm_off():
        rec.configure(enabled=False)
        return None, None

    def arm_on():
        rec.configure(enabled=True, exact_timing=False)
        return UnitMarker(model, live_bytes=None if cuda else (lambda: counter.live_bytes)), None

    def arm_exact():
        rec.configure(enabled=True, exact_timing=True)
        return UnitMarker(model), None

    def arm_tracker():
        from memrt.profiling.cpu_tracker import CpuMemoryTracker

        rec.configure(enabled=True)
        tracker = CpuMemoryTracker().start(extra=[x, y])
        return UnitMarker(model, live_bytes=lambda: tracker.live_bytes), tracker

    arms = {"off": arm_off, "on": arm_on}
    if not args.quick:
        arms["off again (A/A: noise floor)"] = arm_off
    if cuda:
        arms["on+exact_timing"] = arm_exact
    if not (args.no_tracker_arm or args.quick or cuda):
        arms["on+cpu_tracker"] = arm_tracker
    for _ in range(2):  # warm-up: allocator, AdamW state
        _step(model, opt, x, y, None, None)
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    ratios = {kind: {a: [] for a in arms if a != "off"} for kind in ("wall", "cpu")}
    events_per_step = 0.0
    comm_us: list[float] = []
    t_start = time.perf_counter()
    for r in range(rounds):
        names = list(arms)
        names = names[r % len(names):] + names[:r % len(names)]
        this_wall, this_cpu = {}, {}
        for name in names:
            marker, tracker = arms[name]()
            rec.clear()
            if cuda:
                torch.cuda.synchronize()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(steps):
                _step(model, opt, x, y, marker, None)
            if cuda:
                torch.cuda.synchronize()
            this_wall[name] = (time.perf_counter() - t0) / steps
            this_cpu[name] = (time.thread_time() - c0) / steps
            if name == "on":
                events_per_step = (len(rec.memory) + len(rec.trace) + len(rec.comm)) / steps
                comm = rec.to_dict(0)["comm"]  # CUDA: resolves the event timings here, once
                if any(c["seconds"] <= 0 for c in comm):
                    raise RuntimeError("a timed collective has no positive time after resolution")
                comm_us.extend(c["seconds"] * 1e6 for c in comm)
            if marker is not None:
                marker.remove()
            if tracker is not None:
                tracker.stop()
            wall[name].append(this_wall[name])
            cpu[name].append(this_cpu[name])
        for name in ratios["wall"]:
            ratios["wall"][name].append(this_wall[name] / this_wall["off"])
            ratios["cpu"][name].append(this_cpu[name] / this_cpu["off"])
    rec.clear()
    rec.configure(enabled=True, exact_timing=False)
    dist.destroy_process_group()

    rows = []
    for name in arms:
        if name == "off":
            rows.append([name, f"{statistics.median(wall[name]) * 1e3:.1f}", f"{statistics.median(cpu[name]) * 1e3:.1f}",
                         "1.000x (baseline)", "1.000x (baseline)"])
            continue
        rw, rc = ratios["wall"][name], ratios["cpu"][name]
        rows.append([name, f"{statistics.median(wall[name]) * 1e3:.1f}", f"{statistics.median(cpu[name]) * 1e3:.1f}",
                     f"{statistics.median(rw):.3f}x [{min(rw):.2f}, {max(rw):.2f}]",
                     f"{statistics.median(rc):.3f}x [{min(rc):.2f}, {max(rc):.2f}]"])
    print_table(["arm", "wall ms/step", "CPU ms/step", "wall ratio vs off [min, max]", "CPU-time ratio vs off [min, max]"],
                rows, title=f"profiling overhead, GPT {cfg.n_layer}x{cfg.d_model} seq {cfg.seq_len} batch {args.batch}, "
                            f"{rounds} interleaved rounds x {steps} steps, 1 thread")
    replay = replay_seconds([f"blocks.{i}" for i in range(cfg.n_layer)], 200)
    off_cpu = statistics.median(cpu["off"])
    print(f"profiling calls of one step replayed alone: {replay * 1e6:.0f} us = {replay / off_cpu:.2%} of the off "
          f"step's CPU time (best of 5 x 200; excludes the autograd nodes of backward hooks, included above)")
    print(f"timed all-reduce in the on arm: median {statistics.median(comm_us):.0f} us over {len(comm_us)} calls "
          f"({'CUDA events, read lazily' if cuda else 'wall clock'})")
    on_wall, on_cpu = statistics.median(ratios["wall"]["on"]), statistics.median(ratios["cpu"]["on"])
    print(f"profiling on (default) / off: wall {on_wall:.3f}x, CPU time {on_cpu:.3f}x (target <= 1.03x: "
          f"{'met' if max(on_wall, on_cpu) <= 1.03 else 'NOT met'}); {events_per_step:.0f} records per step; "
          f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    write_json(args.out, "profiling_overhead", {
        "machine": info, "config": {"steps": steps, "rounds": rounds, "batch": args.batch, "gpt": str(cfg)},
        "wall_seconds_per_step": wall, "cpu_seconds_per_step": cpu, "ratios_vs_off": ratios,
        "on_ratio_wall_median": on_wall, "on_ratio_cpu_median": on_cpu,
        "replay_seconds_per_step": replay, "records_per_step": events_per_step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
