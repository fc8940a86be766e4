"""Hierarchical vs flat all-reduce on an emulated two-node cluster (2 ranks per node, rate-limited link).

    sudo .venv/bin/python benchmarks/collectives_hier.py            # full: 1, 8, 64 MiB, 5 iterations
    sudo .venv/bin/python benchmarks/collectives_hier.py --quick    # 64 MiB only, 2 iterations

Both algorithms run in the same processes, alternating call by call: torch.distributed's gloo
all_reduce (ring over the 4 ranks: the ring crosses the link twice) and memrt.comm's pipelined
hierarchical all-reduce. Nodes are discovered (network namespaces), not forced. Time per call = the
slowest rank's, median over iterations. Columns follow nccl-tests (doc/PERFORMANCE.md):
algbw = size / time; busbw = algbw * 2 (n - 1) / n for all-reduce (n = ranks). The link bound is the
time for each node to push N bytes across the cut at the link's rate: N * 8 / rate.
Prints the table, the ratio and the share of the link bound; writes JSON with --json PATH.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def worker(sizes: list[int], iters: int) -> None:
    import torch
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm.hierarchical import hierarchical_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = dist.get_topology()
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []

    def timed(fn) -> float:
        tdist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        tdist.all_reduce(dt, op=tdist.ReduceOp.MAX)
        return float(dt)

    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        a, b = x.clone(), x.clone()
        times = {"gloo": [], "memrt": []}
        for it in range(iters + 1):  # first iteration warms up
            tg = timed(lambda: tdist.all_reduce(a))
            tm = timed(lambda: hierarchical_all_reduce(b, "SUM", topo))
            if it:
                times["gloo"].append(tg)
                times["memrt"].append(tm)
            a.copy_(x)
            b.copy_(x)
        ok = True
        tdist.all_reduce(a)
        hierarchical_all_reduce(b, "SUM", topo)
        ok = bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4))
        from memrt.profiling.comm_log import busbw_factor  # the project's one busbw rule

        for algo, ts in times.items():
            t = statistics.median(ts)
            algbw = nbytes / t / 1e9
            rows.append({"size_bytes": nbytes, "count": nbytes // 4, "type": "float", "algorithm": algo,
                         "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor("all_reduce", n),
                         "times_s": ts, "results_match": ok})
    if rank == 0:
        print("RESULT " + json.dumps({"nodes": [list(nd) for nd in topo.nodes], "source": topo.source,
                                       "world": n, "rows": rows}), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB only, 2 iterations")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [64 << 20] if args.quick else [1 << 20, 8 << 20, 64 << 20]
    iters = args.iters or (2 if args.quick else 5)
    if args.worker:
        worker([int(s) for s in args.sizes.split(",")], iters)
        return 0

    from memrt.cluster import EmulatedCluster, can_emulate
    from memrt.testing.launch import run_on_cluster

    ok, why = can_emulate()
    if not ok:
        print(f"skipped: {why}")
        return 0
    with EmulatedCluster(args.rate) as cluster:
        measured_bps = cluster.measure_rate(2.0)
        res = run_on_cluster(["python", __file__, "--worker", "--sizes", ",".join(map(str, sizes)),
                              "--iters", str(iters)], cluster=cluster, env={"OMP_NUM_THREADS": "1"},
                             timeout_s=900)
    line = next(ln for ln in res[0].stdout.splitlines() if ln.startswith("RESULT "))
    data = json.loads(line[len("RESULT "):])
    rate_bps = cluster.rate_bps
    print(f"# emulated cluster: nodes {data['nodes']} ({data['source']}), link {args.rate} "
          f"(measured TCP {measured_bps / 1e9:.3f} Gbit/s), float32 SUM, {iters} iterations, median")
    print(f"# {'size(B)':>10} {'count':>10} {'type':>6} {'algorithm':>9} {'time(us)':>11} {'algbw(GB/s)':>11} "
          f"{'busbw(GB/s)':>11} {'vs gloo':>8} {'link bound':>10}")
    by = {(r["size_bytes"], r["algorithm"]): r for r in data["rows"]}
    summary = {}
    for r in data["rows"]:
        base = by[(r["size_bytes"], "gloo")]["time_us"]
        bound_us = r["size_bytes"] * 8 / rate_bps * 1e6
        speedup = base / r["time_us"]
        share = bound_us / r["time_us"]
        print(f"  {r['size_bytes']:>10} {r['count']:>10} {r['type']:>6} {r['algorithm']:>9} {r['time_us']:>11.0f} "
              f"{r['algbw_GBps']:>11.4f} {r['busbw_GBps']:>11.4f} {speedup:>7.2f}x {share * 100:>9.1f}%")
        if r["algorithm"] == "memrt":
            summary[r["size_bytes"]] = {"speedup_vs_gloo": speedup, "share_of_link_bound": share,
                                        "results_match": r["results_match"]}
    big = summary[max(summary)]
    print(f"64 MiB: memrt hierarchical {big['speedup_vs_gloo']:.2f}x faster than gloo all_reduce "
          f"(target >= 1.3x), {big['share_of_link_bound'] * 100:.1f}% of the link bound (target >= 85%), "
          f"results match: {big['results_match']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"data": data, "summary": summary, "measured_bps": measured_bps, "rate_bps": rate_bps}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
