"""The reference projection of docs/sections/projection.md: the end-to-end GPT's step on 8-1024 nodes.

    python -m benchmarks.projection_reference            # print the tables
    python -m benchmarks.projection_reference --record   # also write benchmarks/records/projection_reference.json

The job is benchmarks/end_to_end.py's (record ``end_to_end``): GPT d=512, 4 layers, vocabulary 1024,
13,200,384 float32 parameters (52,801,536 gradient bytes per step, bucketed as DDP does), 1 x 128 tokens per
rank per step, its compute-only step of 304 ms split 1:2 between forward and backward (the record keeps no
split). It is projected by ``memrt project --json`` itself (run as a command, figures on its command line) to
8 ranks per node, NVLink-class links inside a node (2400 Gbit/s, 2 us) and 25, 100 and 400 Gbit/s per node
across nodes (10 us).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks._common import RECORDS_DIR, machine_info, write_json

NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
LINKS = (25, 100, 400)
ARMS = ("stock", "memrt", "bf16", "int8", "diloco", "fsdp2")
FORWARD_S, BACKWARD_S = 0.101, 0.203
"""The record's compute-only step (304 ms), split 1:2."""
FAST = 100
"""The what-if variant: the same job with its compute FAST times faster (an accelerator's step of a few ms)."""


def job(speedup: float = 1.0) -> list[str]:
    return ["--forward-s", f"{FORWARD_S / speedup:.6g}", "--backward-s", f"{BACKWARD_S / speedup:.6g}",
            "--optimizer-s", "0", "--grad-bytes", "52801536", "--param-bytes", "52801536", "--samples-per-rank", "1",
            "--tokens-per-sample", "128"]
CLUSTER = ["--ranks-per-node", "8", "--intra-gbit", "2400", "--intra-latency-us", "2", "--inter-latency-us", "10",
           "--sync-every", "50"]


def project_command(speedup: float = 1.0) -> list[str]:
    """The ``memrt project`` command line of the reference table (``speedup``: compute that many times faster)."""
    return ["memrt", "project", "--nodes", ",".join(map(str, NODES)), "--inter-gbit", ",".join(map(str, LINKS)),
            *CLUSTER, *job(speedup), "--json"]


def tables(rows: list[dict], what: str) -> list[dict]:
    out = []
    for gbit in LINKS:
        body = []
        for n in NODES:
            arm = {r["arm"]: r for r in rows if r["nodes"] == n and round(r["inter_gbit"]) == gbit}
            stock = arm["stock"]
            body.append([str(n), str(n * 8), f"{stock['step_s'] * 1e3:.0f}", f"{stock['comm_exposed_s'] * 1e3:.0f}",
                         f"{stock['tokens_per_s']:.3g}"]
                        + [f"{arm[a]['speedup_vs_stock']:.2f}x" for a in ARMS[1:]])
        out.append({"title": f"{what}: {gbit} Gbit/s per node across nodes, 8 ranks per node on 2400 Gbit/s inside "
                             "(predicted; speed-up = stock's step / the arm's)",
                    "headers": ["nodes", "ranks", "stock step ms", "stock exposed comm ms", "stock tokens/s",
                                *(f"{a} vs stock" for a in ARMS[1:])],
                    "rows": body})
    return out


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", action="store_true", help="write benchmarks/records/projection_reference.json")
    args = p.parse_args(argv)
    cmd = project_command()
    runs = {}
    for speedup in (1.0, FAST):
        proc = subprocess.run([sys.executable, "-m", "memrt", *project_command(speedup)[1:]], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        runs[speedup] = json.loads(proc.stdout)
    rows = runs[1.0]
    tabs = tables(rows, "measured compute (304 ms)") + tables(runs[FAST], f"compute {FAST}x faster (3 ms)")
    for t in tabs:
        print(t["title"])
        print(" | ".join(t["headers"]))
        for r in t["rows"]:
            print(" | ".join(r))
    if args.record:
        info = machine_info()
        at = {(r["nodes"], round(r["inter_gbit"]), r["arm"]): r["speedup_vs_stock"] for r in rows}
        detail = "; ".join(f"{g} Gbit/s: memrt {at[8, g, 'memrt']:.2f}x-{at[1024, g, 'memrt']:.2f}x, int8 "
                           f"{at[8, g, 'int8']:.2f}x-{at[1024, g, 'int8']:.2f}x, diloco {at[8, g, 'diloco']:.2f}x-"
                           f"{at[1024, g, 'diloco']:.2f}x stock (8 -> 1024 nodes)" for g in LINKS)
        fast = {(r["nodes"], round(r["inter_gbit"]), r["arm"]): r["speedup_vs_stock"] for r in runs[FAST]}
        detail += (f"; compute {FAST}x faster, 100 Gbit/s: memrt {fast[8, 100, 'memrt']:.2f}x-"
                   f"{fast[1024, 100, 'memrt']:.2f}x, int8 {fast[8, 100, 'int8']:.2f}x-{fast[1024, 100, 'int8']:.2f}x")
        record = {"id": "projection_reference", "benchmark": "benchmarks.projection_reference", "topic": "projection",
                  "claim": "predicted speed-up over stock DDP of the end-to-end GPT (measured compute, 52.8 MB of "
                           "gradients per step) on 8-1024 nodes x 8 ranks",
                  "machine": f"model only (no run); computed on {info['cores']} cores, Python {info['python']}",
                  "torch": info["torch"], "commit": None, "date": info["date_utc"].split()[0],
                  "figures": {"detail": detail, "summary": detail.split(";")[0]},
                  "baseline": "stock DDP (flat ring all-reduce per bucket), same model", "target": None,
                  "command": "python -m benchmarks.projection_reference --record  # runs: " + " ".join(cmd),
                  "source": "written by the benchmark from `memrt project --json`", "tables": tabs,
                  "rows": {"measured": _rounded(rows), f"compute_{FAST}x": _rounded(runs[FAST])},
                  "variant_command": " ".join(project_command(FAST))}
        try:
            record["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              check=True).stdout.strip() or None
        except (OSError, subprocess.CalledProcessError):
            pass
        write_json(RECORDS_DIR, "projection_reference", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
