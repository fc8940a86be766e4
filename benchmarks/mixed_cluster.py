"""Mixed cluster: an unchanged DDP job under MEMRT=1 against stock DDP and the bound, and the memrt.balance API.

    cd /work/main && .venv/bin/python -m benchmarks.mixed_cluster                    # job scenarios pair, equal, quad, uneven
    cd /work/main && .venv/bin/python -m benchmarks.mixed_cluster --quick            # shorter
    ... --scenario pair|equal|quad|uneven|api-pair|api-mixed|all --repeats 3 --out DIR  # DIR/mixed_cluster.json
    ... --cap compute|process|both --batch 1024      # what a cap slows (job scenarios), the per-rank batch
    cd /work/main && .venv/bin/python -m benchmarks.mixed_cluster --gpu-check  # CUDA side (gpu_check.sh)

Job scenarios (``benchmarks/balance_job.py``: DistributedSampler + DataLoader(batch_size=b), an MLP, SGD; it
never imports memrt). Each of ``--repeats`` rounds measures, for the same caps: each rank's standalone speed
(all ranks at once, each as its own one-rank job: nobody waits for anybody), stock DDP, and ``MEMRT=1`` (nothing
else set), and where the caps differ the homogeneous reference (the same ranks each capped at the caps' mean:
standalone speeds and stock DDP), round i starting with the i-th arm; the bound is the sum of the standalone speeds,
and each figure is the median over the rounds. Samples/s count the steps after ``--warmup`` (memrt's first
decisions fall inside it). Final loss (the whole dataset, final model) and parameters of MEMRT=1 vs stock:
- ``pair``: 2 ranks, rank 1 capped at 0.5 CPU (cgroup quota, root);
- ``equal``: 2 ranks, no cap (MEMRT=1 must not be slower than stock: no balancing when it would not pay);
- ``quad``: 4 ranks capped at 1/1/0.5/0.25 CPU;
- ``uneven``: 4 ranks on the emulated cluster's two namespaces, 3+1 (ranks 0-2 | rank 3, 1 Gbit/s link),
  rank 3 capped at 0.25 CPU (root; ``MEMRT_TOPOLOGY=0,1,2;3``; without namespaces it runs on loopback).
What a cap slows (``--cap``): ``compute`` (default) caps each rank's main thread, which runs its forward,
backward, data loading (no DataLoader workers here) and optimizer step, and leaves its communication threads
(gloo's, memrt's) free: a slow accelerator, whose network is not slower (approximately: Python callbacks on
those threads wait while the quota pauses the main thread holding the GIL; cgroup v1 only, elsewhere it
falls back to ``process``, printed); ``process`` caps the whole process, communication included: a CPU-only
helper rank; ``both`` runs every scenario both ways.
Each scenario first checks that its caps slow the capped ranks alone as much as their share of the cores
says (4 ranks on 2 cores get about 0.5 CPU each, so a 0.5 cap would change nothing); it fails otherwise.
Without root the caps become a sleep per sample in forward (``BALANCE_JOB_DELAY``), printed as such.

API scenarios (the ``SpeedBalancer`` API in one process group, stock DDP alternating with it):
- ``api-pair``: 2 ranks, rank 1 capped at 0.5 CPU (cgroup quota, root).
- ``api-mixed``: 4 ranks on uneven nodes 3+1 (``MEMRT_TOPOLOGY=0,1,2;3``), rank 3 capped at 0.2 CPU (4 ranks
  share 2 cores, so an uncapped rank gets about 0.5), and per-rank memory budgets: rank 0 holds at most
  1.5x the uniform micro-batch, rank 3 at most the uniform one (bounds from each budget in bytes and the
  per-sample activation bytes measured with saved-tensor hooks).
Both modes train copies of one model on the same global batches, alternating phases of a few steps
(one untimed warm-up phase each); the ratio is memrt samples/s / stock samples/s, and the largest
parameter difference between the two modes after the run is printed as a check.
Without root the slow rank is emulated by a sleep per sample in forward (printed as such). On a machine
shared with other work, ``--priority 8`` gives every rank's cgroup 8x the default CPU weight, so the
uncapped ranks keep about a full CPU and the caps alone make the slow rank slow.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from benchmarks._common import base_parser, fmt_ratio, machine_info, machine_line, print_table, write_json
from memrt.balance import max_samples_for_budget
from memrt.testing.balance import Spec, make_model, side_by_side
from memrt.cluster.cpucap import can_cap
from memrt.testing import run_processes

from benchmarks._balance_jobs import BATCH, CAP_MODES, print_job_table, run_job


def _memory_model(spec: Spec) -> tuple[int, float]:
    """(fixed bytes: params + grads + momentum, activation bytes saved per sample) of the benchmark model."""
    import torch
    import torch.nn.functional as F

    from memrt.balance import estimate_sample_bytes

    model = make_model(spec)
    fixed = 3 * sum(p.numel() * p.element_size() for p in model.parameters())

    def make(n):
        return torch.randn(n, spec.in_features), torch.randint(0, spec.n_classes, (n,))

    per_sample = estimate_sample_bytes(model, make, F.cross_entropy, batch_sizes=(4, 8))
    return fixed, per_sample


def _scenario(name: str, quick: bool, capped: bool, priority: float) -> tuple[Spec, int, dict[str, str], dict]:
    if name == "pair":
        spec = Spec(global_batch=1024 if quick else 2048, phase_steps=3 if quick else 4, phases=2 if quick else 3,
                    width=512, depth=4, rebalance_every=3)
        slow = {1: 0.5}
        return _finish(spec, 2, slow, capped, {}, priority=priority)
    spec = Spec(global_batch=512 if quick else 2048, phase_steps=3 if quick else 4, phases=2 if quick else 3,
                width=512, depth=4, rebalance_every=3, use_memrt_comm=True)
    world = 4
    uniform = spec.global_batch // world
    info = {}
    bounds = {}
    fixed, per = _memory_model(spec)
    for rank, factor in ((0, 1.5), (3, 1.0)):
        budget = int(fixed + per * uniform * factor) + 1
        bounds[rank] = max_samples_for_budget(budget, fixed, per)
        info[f"rank{rank}_budget_bytes"] = budget
    info["bytes_per_sample"] = per
    spec.max_samples = bounds
    return _finish(spec, world, {3: 0.2}, capped, {"MEMRT_TOPOLOGY": "0,1,2;3"}, info, priority=priority)


def _finish(spec, world, slow, capped, env, info=None, *, priority=1.0):
    env = dict(env)
    info = dict(info or {})
    if capped:
        caps = {r: f"{slow[r]}@{priority}" if r in slow else f"max@{priority}" for r in range(world)}
        if priority == 1.0:
            caps = {r: str(c) for r, c in slow.items()}
        env["MEMRT_CPU_CAP"] = ",".join(f"{r}={c}" for r, c in caps.items())
        info["slow"] = {r: f"cgroup cap {c} CPU" for r, c in slow.items()}
        info["priority"] = priority
    else:  # emulate: a sleep per sample that makes the rank about 1/c times slower
        spec.delay_s_per_sample = {r: 0.0002 * (1 / c - 1) for r, c in slow.items()}
        info["slow"] = {r: f"sleep {d * 1e3:.2f} ms/sample (no root)" for r, d in spec.delay_s_per_sample.items()}
    return spec, world, env, info


def run(name: str, quick: bool, priority: float = 1.0) -> dict:
    capped, why = can_cap()
    spec, world, env, info = _scenario(name, quick, capped, priority)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    res = run_processes(side_by_side, world, asdict(spec), env=env, timeout=600, pg_timeout_s=300)
    r0 = res[0]
    sps = r0["samples_per_s"]
    diff = max(float(abs(a - b).max()) for a, b in zip(r0["params"]["stock"], r0["params"]["memrt"]))
    return {
        "scenario": name, "world": world, "global_batch": spec.global_batch, "env": env, "info": info,
        "cap_unavailable": None if capped else why, "stock_samples_per_s": sps["stock"],
        "memrt_samples_per_s": sps["memrt"], "ratio": sps["memrt"] / sps["stock"], "final_shares": r0["shares"],
        "max_samples": spec.max_samples,
        "decisions": [(d["step"], d["shares"], [round(x) for x in d["samples_per_s"]]) for d in r0["decisions"]],
        "max_param_diff_memrt_vs_stock": diff, "wall_s": time.perf_counter() - t0,
        "load_avg_1min_before": load0,
    }


def _gpu_check_rank(rank: int, world: int) -> dict:
    """Rank 0 on CUDA, rank 1 on CPU: staged collectives and the weighted DDP hook across device kinds."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memrt.balance import BalanceConfig, SpeedBalancer
    from memrt.testing.balance import make_dataset, make_model
    from memrt.comm.mixed import MixedComm, choose_backend

    device = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    out: dict = {"native_all_cuda": choose_backend(["cuda", "cuda"]).backend}
    mc = MixedComm(device=device)
    out["choice"] = [mc.choice.backend, list(mc.choice.kinds), list(mc.choice.staged)]
    x = torch.full((1000,), float(rank + 1), device=device)
    out["all_reduce_ok"] = bool(torch.all(mc.all_reduce(x) == 3.0).item()) and x.device == device
    spec = Spec(global_batch=8, phase_steps=2, phases=1, width=32, depth=2, in_features=16)
    ds, model = make_dataset(spec), make_model(spec).to(device)
    try:
        ddp = DDP(model, device_ids=[0] if rank == 0 else None, broadcast_buffers=False)
        bal = SpeedBalancer(8, shares=(5, 3), config=BalanceConfig(adaptive=False))
        bal.attach(ddp, mixed=mc)
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
        for xb, yb in torch.utils.data.DataLoader(ds, batch_sampler=bal.sampler(ds, seed=spec.seed)):
            opt.zero_grad(set_to_none=True)
            with bal.step(len(xb)):
                F.cross_entropy(ddp(xb.to(device)), yb.to(device)).backward()
            opt.step()
        out["params"] = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    except Exception as exc:  # report, do not hide: the GPU run decides
        out["ddp_error"] = f"{type(exc).__name__}: {exc}"
    out["staged_bytes"] = mc.staged_bytes
    return out


def gpu_check() -> int:
    """CUDA side of mixed device kinds (benchmarks/gpu_check.sh): exit 0 when every check passes."""
    import numpy as np
    import torch

    from memrt.testing.balance import reference_params

    if not torch.cuda.is_available():
        print("SKIP gpu-check: no CUDA device")
        return 0
    res = run_processes(_gpu_check_rank, 2, timeout=300)
    ref = reference_params(Spec(global_batch=8, phase_steps=2, phases=1, width=32, depth=2, in_features=16))
    checks = {
        "all-cuda group -> nccl": res[0]["native_all_cuda"] == "nccl",
        "cuda+cpu -> gloo, cuda rank staged": res[0]["choice"] == ["gloo", ["cuda", "cpu"], [True, False]],
        "staged all_reduce (cuda tensor) correct": res[0]["all_reduce_ok"] and res[1]["all_reduce_ok"],
        "only the cuda rank staged bytes": res[0]["staged_bytes"] > 0 and res[1]["staged_bytes"] == 0,
        "weighted DDP across cuda+cpu == full-batch reference (rtol 1e-4)": all(
            "params" in r and all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(r["params"], ref))
            for r in res),
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    for r in res:
        if "ddp_error" in r:
            print(f"  ddp error: {r['ddp_error']}")
    return 0 if all(checks.values()) else 1


def main(argv=None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--scenario", choices=("pair", "equal", "quad", "uneven", "api-pair", "api-mixed", "all", "jobs"),
                   default="jobs")
    p.add_argument("--repeats", type=int, default=1, help="job scenarios: stock / MEMRT=1 runs, alternating (medians)")
    p.add_argument("--gpu-check", action="store_true", help="run the CUDA checks of mixed device kinds and exit")
    p.add_argument("--priority", type=float, default=1.0,
                   help="CPU weight multiplier for every rank's cgroup (root): on a machine shared with other "
                        "work, e.g. 8 keeps uncapped ranks near a full CPU so the caps set the speed ratio")
    p.add_argument("--cap", choices=(*CAP_MODES, "both"), default="compute",
                   help="job scenarios: cap each rank's compute thread (its communication runs free) or the whole "
                        "process (default: %(default)s)")
    p.add_argument("--batch", type=int, default=BATCH,
                   help="job scenarios: per-rank batch b (default %(default)s; --quick uses 64)")
    args = p.parse_args(argv)
    info = machine_info()
    print(machine_line(info), flush=True)
    if args.gpu_check:
        return gpu_check()
    names = {"all": ("pair", "equal", "quad", "uneven", "api-pair", "api-mixed"),
             "jobs": ("pair", "equal", "quad", "uneven")}.get(args.scenario, (args.scenario,))
    caps = CAP_MODES if args.cap == "both" else (args.cap,)
    jobs = [run_job(n, args.quick, args.priority, args.repeats, batch=args.batch, cap=c)
            for c in caps for n in names if not n.startswith("api-")]
    if jobs:
        print_job_table(jobs)
    rows = [run(n[4:], args.quick, args.priority) for n in names if n.startswith("api-")]
    if not rows:
        write_json(args.out, "mixed_cluster", {"machine": info, "quick": args.quick, "jobs": jobs})
        return 0
    print_table(["scenario", "ranks (nodes)", "B", "stock samples/s", "memrt samples/s", "memrt/stock",
                 "final shares", "memory bound (samples)", "max param diff", "slow rank"],
                [[r["scenario"], f"{r['world']} ({r['env'].get('MEMRT_TOPOLOGY', '1 node')})", r["global_batch"],
                  f"{r['stock_samples_per_s']:.1f}", f"{r['memrt_samples_per_s']:.1f}", fmt_ratio(r["ratio"]),
                  r["final_shares"], r["max_samples"] or "-", f"{r['max_param_diff_memrt_vs_stock']:.1e}",
                  "; ".join(f"rank {k}: {v}" for k, v in r["info"]["slow"].items())] for r in rows],
                title="mixed cluster: memrt speed-weighted DP vs stock DDP (same global batches, same run)")
    for r in rows:
        if r["cap_unavailable"]:
            print(f"note: no CPU cap ({r['cap_unavailable']}); slow rank emulated by sleeping", flush=True)
    write_json(args.out, "mixed_cluster", {"machine": info, "quick": args.quick, "jobs": jobs, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
