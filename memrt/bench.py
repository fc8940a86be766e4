"""``memrt bench comm``: probe the links, then time each all-reduce algorithm against its prediction.

Run it under a launcher (``torchrun --nproc-per-node 2 -m memrt bench comm``, ``mpiexec -n 4 memrt
bench comm``) or alone, which spawns ``--local N`` processes on this machine (gloo on loopback,
``MEMRT_TOPOLOGY`` from ``--topology``). The probe always runs afresh here and refreshes the cache
that later jobs load. :func:`measure` is the worker, shared with ``benchmarks/comm_compress.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from memrt.sizes import format_bytes

__all__ = ["add_arguments", "run", "measure", "timed"]

ALGORITHMS = ("flat", "hier", "hier+bf16", "hier+int8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", default="comm", choices=["comm"], help="what to benchmark (comm)")
    p.add_argument("--sizes", default="1MiB,16MiB,64MiB", help="all-reduce sizes (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per size and algorithm (median)")
    p.add_argument("--local", type=int, default=4, help="processes to spawn when not under a launcher")
    p.add_argument("--topology", default="0,1;2,3", help="MEMRT_TOPOLOGY for --local runs (default: %(default)s)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")


def timed(fn, reps: int, *, warmup: int = 1) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn()`` between barriers (collective)."""
    import torch
    import torch.distributed as tdist

    times = []
    for i in range(warmup + reps):
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        tdist.all_reduce(dt, op=tdist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return statistics.median(times)


SMALL_BYTES = 1 << 20
SMALL_REPS = 15
"""Calls of at most SMALL_BYTES are timed at least SMALL_REPS times: they take milliseconds, and on shared
cores one descheduled rank moves a median of a few by tens of percent."""


def measure(*, sizes: list[int], reps: int, algorithms: tuple[str, ...] = ALGORITHMS, baseline: bool = True,
            sweep: list[int] | None = None, fusion: bool = False, force_probe: bool = False,
            reduce_scatter: list[int] | None = None) -> dict[str, Any]:
    """Collective over an initialized memrt.comm job; returns the same dict on every rank. ``reduce_scatter``:
    input sizes at which FSDP2's gradient reduce-scatter is timed too (gloo, memrt hier, hier+<codec> with error
    feedback, as :class:`memrt.comm.fsdp_comms.MemrtReduceScatter` runs it)."""
    from memrt.comm.setup import override

    with override(comm="auto", compress="none"):  # each arm below forces only its algorithm
        return _measure(sizes=sizes, reps=reps, algorithms=algorithms, baseline=baseline, sweep=sweep, fusion=fusion,
                        force_probe=force_probe, reduce_scatter=reduce_scatter or [])


def _reduce_scatter_arms(sizes: list[int], reps: int, model: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist

    from memrt.comm import api, costmodel
    from memrt.comm.compress import FeedbackKey
    from memrt.comm.setup import STATE, override

    topo = STATE.topology
    out: dict[str, Any] = {}
    for n in sizes:
        world = topo.world_size
        x = torch.randn(n // 4 // world * world, generator=torch.Generator().manual_seed(topo.rank))
        o = torch.empty(x.numel() // world)
        row: dict[str, Any] = {"gloo": {"measured": timed(lambda: tdist.reduce_scatter_tensor(o, x), reps)}}
        for a in ALGORITHMS:
            if a == "flat":
                continue
            codec = a.split("+", 1)[1] if "+" in a else None
            key = FeedbackKey(owner=("bench", "reduce_scatter", a)) if codec else None
            with override(comm="hier"):
                row[a] = {"measured": timed(lambda: api.reduce_scatter_tensor(o, x, compress=codec, key=key), reps),
                          "predicted": costmodel.predict("hier", x.numel() * 4, topo.nodes, model, codec=codec,
                                                      op="reduce_scatter")}
        out[str(x.numel() * 4)] = row
    return out


def _measure(*, sizes: list[int], reps: int, algorithms: tuple[str, ...], baseline: bool, sweep: list[int] | None,
             fusion: bool, force_probe: bool, reduce_scatter: list[int]) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm import api, costmodel, probe, select
    from memrt.comm.setup import STATE, override
    from memrt.profiling.recorder import get_recorder

    topo = dist.get_topology()

    def reps_for(nbytes: int) -> int:
        return max(reps, SMALL_REPS) if nbytes <= SMALL_BYTES else reps

    t0 = time.perf_counter()
    model, probed = probe.ensure_link_model(topo.nodes, topo.device_kinds, force=force_probe, topology=topo,
                                            groups=STATE.groups, collectives=api)
    out: dict[str, Any] = {"nodes": [list(n) for n in topo.nodes], "probe_seconds": time.perf_counter() - t0,
                           "probed": probed, "links": json.loads(model.to_json()), "sizes": {}}
    multi = topo.hierarchical_useful
    algos = [a for a in algorithms if multi or a == "flat"]
    get_recorder().clear()
    for n in sizes:
        x = torch.randn(n // 4, generator=torch.Generator().manual_seed(topo.rank))
        row: dict[str, Any] = {}
        if baseline:
            row["gloo"] = {"measured": timed(lambda: tdist.all_reduce(x), reps_for(n))}
        for a in algos:
            with override(comm="flat" if a == "flat" else "hier"):
                row[a] = {"measured": timed(_caller(x, a), reps_for(n)),
                          "predicted": costmodel.predict(a.split("+", 1)[0], n, topo.nodes, model,
                                                      codec=a.split("+", 1)[1] if "+" in a else None)}
        d = select.choose("all_reduce", n, torch.float32, topo, api.settings(), model=model)
        row["auto"] = {"algorithm": d.label, "reason": d.reason}
        out["sizes"][str(n)] = row
    if sweep and multi:
        rows = []
        for n in sweep:
            x = torch.randn(max(1, n // 4), generator=torch.Generator().manual_seed(n))
            # the two take turns call by call, so drift on a shared machine hits both alike
            samples: dict[str, list[float]] = {"flat": [], "hier": []}
            for i in range(1 + reps_for(n)):
                for a in samples:
                    with override(comm=a):
                        t = timed(lambda: dist.all_reduce(x), 1, warmup=0)
                    if i:  # the first round warms up
                        samples[a].append(t)
            meas = {a: statistics.median(v) for a, v in samples.items()}
            d = select.choose("all_reduce", n, torch.float32, topo, api.settings(), model=model)
            rows.append({"bytes": n, "measured": meas, "chosen": d.label, "predicted": d.candidates,
                         "fastest": min(meas, key=meas.get)})
        out["sweep"] = rows
    if fusion:
        gen = torch.Generator().manual_seed(topo.rank)
        ts = [torch.randn(4096, generator=gen) for _ in range(256)]  # 256 tensors of 16 KiB
        out["fusion"] = {
            "separate_gloo": timed(lambda: [tdist.all_reduce(t) for t in ts], reps),
            "all_reduce_coalesced": timed(lambda: dist.all_reduce_coalesced(ts), reps),
            "auto_coalesced_async": timed(lambda: [w.wait() for w in [dist.all_reduce(t, async_op=True) for t in ts]],
                                          reps),
        }
    if reduce_scatter and multi and topo.is_uniform:
        out["reduce_scatter"] = _reduce_scatter_arms(reduce_scatter, reps, model)
    out["explain"] = dist.explain()
    return out


def _caller(x, algorithm: str):
    """One all-reduce of ``x`` under ``algorithm``; compressed arms run as DDP's gradients do (error feedback)."""
    import torch.distributed as tdist

    from memrt.comm import api
    from memrt.comm.compress import FeedbackKey

    if "+" not in algorithm:
        return lambda: api.all_reduce(x)
    codec, key = algorithm.split("+", 1)[1], FeedbackKey(owner=("bench", algorithm, x.numel()))
    return lambda: api.all_reduce_with(x, tdist.ReduceOp.SUM, None, False, key=key, codec=codec)


def _fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def report(res: dict[str, Any]) -> str:
    """Human-readable tables of :func:`measure`'s result."""
    lines = [f"nodes {res['nodes']}; probe {'ran' if res['probed'] else 'loaded from cache'} "
             f"({res['probe_seconds']:.2f} s)"]
    links = res["links"]
    for tier in ("intra", "inter"):
        t = links.get(tier)
        if t:
            shared = t.get("shared_beta_s_per_byte")
            lines.append(f"  {tier}: alpha {t['alpha_s'] * 1e6:.0f} us, {1 / max(t['beta_s_per_byte'], 1e-15) / 1e6:.0f} MB/s"
                         + (f" ({1 / max(shared, 1e-15) / 1e6:.0f} MB/s per flow when shared)" if shared else ""))
    lines.append("     size  algorithm     measured   predicted  pred/meas  vs gloo")
    for n, row in res["sizes"].items():
        base = row.get("gloo", {}).get("measured")
        for a, v in row.items():
            if a == "auto":
                continue
            pred = v.get("predicted")
            lines.append(f"{format_bytes(int(n)):>9s}  {a:10s}  {_fmt(v['measured']):>10s}  "
                         f"{_fmt(pred) if pred else '-':>10s}  {pred / v['measured'] if pred else float('nan'):9.2f}  "
                         f"{base / v['measured'] if base else float('nan'):6.2f}x")
        lines.append(f"           auto -> {row['auto']['algorithm']}: {row['auto']['reason']}")
    return "\n".join(lines)


def _local_worker(rank: int, world: int, sizes: list[int], reps: int) -> dict[str, Any]:
    import torch.distributed as tdist

    from memrt.comm import api

    api.setup_topology(health=False)
    try:
        return measure(sizes=sizes, reps=reps, force_probe=True)
    finally:
        tdist.barrier()


def run(args: argparse.Namespace) -> int:
    from memrt.config import parse_size
    from memrt.launcher import discover_launch

    sizes = [parse_size("--sizes", s) for s in args.sizes.split(",") if s.strip()]
    info = discover_launch()
    if info.world_size > 1:
        import memrt.comm as dist

        dist.init_process_group()
        res = measure(sizes=sizes, reps=args.reps, force_probe=True)
        if dist.get_rank() == 0:
            print(report(res))
            print(res["explain"])
        dist.destroy_process_group()
    else:
        from memrt.testing import run_processes

        res = run_processes(_local_worker, args.local, sizes, args.reps, env={"MEMRT_TOPOLOGY": args.topology},
                            timeout=600)[0]
        print(report(res))
        print(res["explain"])
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0
