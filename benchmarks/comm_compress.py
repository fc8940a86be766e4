"""Slow-tier compression, fusion and the cost model on an emulated 2x2 cluster (1 Gbit/s) and on loopback.

Baseline, measured in the same run: torch.distributed (gloo) all_reduce over all 4 ranks, and 256
separate gloo all_reduce calls for the fusion arm. memrt arms go through ``memrt.comm.all_reduce``
with the algorithm forced per arm (flat, hier, hier+bf16, hier+int8); ``auto`` is the cost model's
choice. A 64 MiB reduce-scatter (FSDP2's gradients) is timed too: gloo's ``reduce_scatter_tensor`` against
memrt's hier, hier+bf16 and hier+int8 with error feedback. Every time is the median over repeats of the slowest rank's time between barriers.

    sudo .venv/bin/python -m benchmarks.comm_compress [--quick] [--where emulated|loopback|both|codecs]

The emulated cluster needs root (network namespaces); without it that part prints SKIP. ``--where codecs``
(also part of ``both``) times the codecs alone, one thread, on 32 MiB of float32: encode, encode with error
feedback and the decoded copy (what the pipeline runs per chunk), decode, decode-accumulate.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import base_parser, machine_info, machine_line, print_table, skip_line, write_json

MiB = 1 << 20
SIZES = [1 * MiB, 16 * MiB, 64 * MiB]
SWEEP = [16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
TOPOLOGY = "0,1;2,3"


def _worker(rank: int, url: str, out: str, reps: int, cache: str) -> None:
    from datetime import timedelta

    import torch

    import memrt.comm as dist
    from memrt.bench import measure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=4, timeout=timedelta(seconds=300))
    res = measure(sizes=SIZES, reps=reps, sweep=SWEEP, fusion=True, reduce_scatter=[64 * MiB])
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def _loopback_worker(rank: int, world: int, reps: int) -> dict[str, Any]:
    from memrt.comm import api
    from memrt.bench import measure

    api.setup_topology(health=False)
    return measure(sizes=SIZES, reps=reps, sweep=SWEEP, fusion=True, reduce_scatter=[64 * MiB])


def run_emulated(reps: int, tmp: str) -> dict[str, Any]:
    from memrt.cluster import EmulatedCluster
    from memrt.config import environ

    out = str(Path(tmp) / "emulated.json")
    env = dict(environ(), MEMRT_TOPOLOGY=TOPOLOGY, MEMRT_REPORT_DIR=str(Path(tmp) / "cache"))
    with EmulatedCluster("1gbit") as cluster:
        url = f"tcp://{cluster.addrs[0]}:{random.randint(20000, 40000)}"
        procs = [cluster.popen(0 if r < 2 else 1, ["python", "-m", "benchmarks.comm_compress", "--worker", str(r), url,
                                                   out, str(reps), tmp], env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(4)]
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errs.append(err[-2000:])
        if errs:
            raise RuntimeError("emulated-cluster workers failed:\n" + "\n".join(errs))
    return json.loads(Path(out).read_text())


def run_loopback(reps: int, tmp: str) -> dict[str, Any]:
    from memrt.testing import run_processes

    return run_processes(_loopback_worker, 4, reps, env={"MEMRT_TOPOLOGY": TOPOLOGY,
                                                          "MEMRT_REPORT_DIR": str(Path(tmp) / "cache-lo")},
                         timeout=600)[0]


def summarize(where: str, res: dict[str, Any]) -> dict[str, Any]:
    rows, acc = [], []
    for n, row in res["sizes"].items():
        base = row["gloo"]["measured"]
        for a, v in row.items():
            if a in ("auto", "gloo"):
                continue
            ratio = v["predicted"] / v["measured"]
            acc.append({"bytes": int(n), "algorithm": a, "pred_over_meas": ratio})
            rows.append((f"{int(n) // MiB} MiB", a, f"{v['measured'] * 1e3:.1f} ms", f"{v['predicted'] * 1e3:.1f} ms",
                         f"{ratio:.2f}", f"{base / v['measured']:.2f}x",
                         "<- auto" if row["auto"]["algorithm"] == a else ""))
        rows.append((f"{int(n) // MiB} MiB", "gloo (baseline)", f"{base * 1e3:.1f} ms", "-", "-", "1.00x", ""))
    print_table(["size", "algorithm", "measured", "predicted", "pred/meas", "speed-up vs gloo", ""], rows,
                title=f"{where}: all_reduce float32, 2 nodes x 2 ranks")
    sweep = res.get("sweep", [])
    hits = sum(1 for s in sweep if s["chosen"] == s["fastest"])
    print_table(["bytes", "flat measured", "hier measured", "chosen", "fastest"],
                [(s["bytes"], f"{s['measured']['flat'] * 1e3:.2f} ms", f"{s['measured']['hier'] * 1e3:.2f} ms",
                  s["chosen"], s["fastest"]) for s in sweep], title=f"{where}: choice sweep ({hits}/{len(sweep)} fastest)")
    fu = res.get("fusion", {})
    if fu:
        print_table(["arm", "time", "vs 256 separate gloo calls"],
                    [(k, f"{v * 1e3:.1f} ms", f"{fu['separate_gloo'] / v:.2f}x") for k, v in fu.items()],
                    title=f"{where}: 256 tensors of 16 KiB")
    rs = res.get("reduce_scatter", {})
    for n, row in rs.items():
        base = row["gloo"]["measured"]
        print_table(["algorithm", "measured", "predicted", "speed-up vs gloo"],
                    [(a, f"{v['measured'] * 1e3:.1f} ms", f"{v['predicted'] * 1e3:.1f} ms" if "predicted" in v else "-",
                      f"{base / v['measured']:.2f}x") for a, v in row.items()],
                    title=f"{where}: reduce_scatter of {int(n) // MiB} MiB float32 (FSDP2's gradients; "
                          "int8 with error feedback)")
    print(res["explain"])
    chosen_acc = [a for a in acc if a["algorithm"] == res["sizes"][str(a["bytes"])]["auto"]["algorithm"]]
    s64 = res["sizes"][str(64 * MiB)]
    return {
        "pred_over_meas": acc,
        "chosen_within_25pct": all(0.75 <= a["pred_over_meas"] <= 1.25 for a in chosen_acc),
        "all_within_25pct": sum(0.75 <= a["pred_over_meas"] <= 1.25 for a in acc) / max(1, len(acc)),
        "sweep_fastest_share": hits / max(1, len(sweep)),
        "speedup_64mib": {a: s64["gloo"]["measured"] / s64[a]["measured"] for a in s64 if a not in ("auto", "gloo")},
        "reduce_scatter_speedup": {n: {a: row["gloo"]["measured"] / v["measured"]
                                       for a, v in row.items() if a != "gloo"} for n, row in rs.items()},
        "fusion_speedup": fu["separate_gloo"] / fu["all_reduce_coalesced"] if fu else None,
        "auto_fusion_speedup": fu["separate_gloo"] / fu["auto_coalesced_async"] if fu else None,
        "links": res["links"],
    }


def codec_times(nbytes: int = 32 * MiB, reps: int = 7) -> dict[str, dict[str, float]]:
    """Best-of-``reps`` seconds of each codec operation on ``nbytes`` of float32, one thread."""
    import time

    import torch

    from memrt.comm.codecs import CODECS, decode, encode

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = nbytes // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        residual, sent, out = torch.zeros(n), torch.empty(n), torch.zeros(n)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        res = {}
        for codec in CODECS:
            payload = encode(x, codec)
            res[codec] = {"encode": best(lambda: encode(x, codec)),
                          "encode_ef_sent": best(lambda: encode(x, codec, residual=residual, sent_out=sent)),
                          "decode": best(lambda: decode(payload, codec, n)),
                          "decode_accumulate": best(lambda: decode(payload, codec, n, out=out, accumulate=True))}
        print_table(["codec", *next(iter(res.values()))],
                    [(c, *(f"{v * 1e3:.1f} ms" for v in r.values())) for c, r in res.items()],
                    title=f"codecs on {nbytes // MiB} MiB float32, 1 thread (best of {reps})")
        return res
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(int(argv[1]), argv[2], argv[3], int(argv[4]), argv[5])
        return 0
    p = base_parser(__doc__)
    p.add_argument("--where", default="both", choices=["emulated", "loopback", "both", "codecs"])
    args = p.parse_args(argv)
    info = machine_info()
    print(machine_line(info))
    reps = 2 if args.quick else 5
    payload: dict[str, Any] = {"machine": info, "reps": reps}
    if args.where in ("codecs", "both"):
        payload["codecs_32mib_seconds"] = codec_times(reps=3 if args.quick else 7)
    with tempfile.TemporaryDirectory(prefix="memrt-comm-bench-") as tmp:
        if args.where in ("emulated", "both"):
            from memrt.cluster import can_emulate

            ok, why = can_emulate()
            if ok:
                payload["emulated"] = summarize("emulated 1 Gbit/s", run_emulated(reps, tmp))
            else:
                payload["emulated"] = skip_line("emulated", why)
        if args.where in ("loopback", "both"):
            payload["loopback"] = summarize("loopback", run_loopback(reps, tmp))
    for where in ("emulated", "loopback"):
        s = payload.get(where)
        if s and "speedup_64mib" in s:
            sp = s["speedup_64mib"]
            print(f"{where}: 64 MiB vs gloo: " + ", ".join(f"{a} {v:.2f}x" for a, v in sp.items())
                  + f"; fused 256x16KiB vs separate gloo: {s['fusion_speedup']:.2f}x (auto-coalesced async "
                  f"{s['auto_fusion_speedup']:.2f}x); chosen=fastest in {s['sweep_fastest_share']:.0%} of the sweep; "
                  f"cost model within 25% for the chosen algorithm at 1/16/64 MiB: {s['chosen_within_25pct']}, "
                  f"all arms: {s['all_within_25pct']:.0%}")
    write_json(args.out, "comm_compress", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
