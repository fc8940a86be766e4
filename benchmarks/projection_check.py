"""Check ``memrt project``'s model against measured runs: calibrate on one run, print predicted / measured for the rest.

    python -m benchmarks.projection_check                                  # the end_to_end record's arms
    python -m benchmarks.projection_check --measured runs.json --calibrate stock@2x2@0.96g
    python -m benchmarks.projection_check --end-to-end DIR1 DIR2 ...     # benchmarks.end_to_end --out folders

A measurements file (``--measured``) is JSON: ``{"job": {...}, "runs": [...]}`` where ``job`` holds
:class:`memrt.comm.projection.JobFigures`' fields (``forward_s``, ``backward_s``, ``grad_bytes`` instead of
``bucket_bytes``, ...) and each run ``{"shape": [2, 2], "inter_gbit": 0.96, "intra_gbit": 20, "arm": "stock",
"step_s": 1.002}`` (optionally ``"speeds"``, ``"sync_every"``, ``"label"``): the measured step of one arm on one
emulated shape (ranks per node). Without ``--measured`` the runs are built from benchmarks/records/end_to_end.json
(one shape, 2 x 2 at the 0.96 Gbit/s it measured; arms stock, memrt, bf16, int8; the job's compute-only step).

Calibration: one factor k on the job's compute (forward and backward) such that the calibration run's predicted
step equals its measured one (bisection); every run is then predicted with that k. The emulated links' figures are
what the runs measured (``inter_gbit``) and ``intra_gbit`` (loopback inside a namespace; default 20).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memrt.comm import projection as pj

RECORDS = Path(__file__).resolve().parent / "records"
_ARM_OF = {"stock": "stock", "`MEMRT=1` (exact)": "memrt", "`MEMRT_COMPRESS=bf16`": "bf16",
           "`MEMRT_COMPRESS=int8`": "int8"}


def from_end_to_end(path: Path = RECORDS / "end_to_end.json", intra_gbit: float = 20.0) -> dict[str, Any]:
    """Measurements of the end_to_end record: GPT d=512 (52.8 MB of gradients), 2 x 2 ranks at 0.96 Gbit/s."""
    rec = json.loads(path.read_text())
    rows = {r[0]: r for r in rec["tables"][0]["rows"] if len(r) > 2}
    compute = float(rows["compute-only"][2]) / 1e3
    runs = [{"shape": [2, 2], "inter_gbit": 0.96, "intra_gbit": intra_gbit, "arm": arm, "label": name,
             "step_s": float(rows[name][2]) / 1e3} for name, arm in _ARM_OF.items() if name in rows]
    return {"job": {"forward_s": compute / 3, "backward_s": 2 * compute / 3, "grad_bytes": 52801536,
                    "samples_per_rank": 1, "tokens_per_sample": 128}, "runs": runs}


_E2E_ARMS = {"stock": "stock", "memrt": "memrt", "memrt-bf16": "bf16", "memrt-int8": "int8"}


def from_end_to_end_runs(folders: list[Path], intra_gbit: float = 20.0) -> dict[str, Any]:
    """Measurements of ``benchmarks.end_to_end --out DIR`` runs (one per link rate, 2 x 2 ranks): each arm's
    measured step at the link rate the run measured; the job's compute from the first run with a
    ``compute-only`` arm, its gradient bytes from the model's parameters (float32)."""
    runs, job = [], None
    for folder in folders:
        data = json.loads((folder / "end_to_end.json").read_text())
        if not data.get("link_bps"):
            raise SystemExit(f"{folder}: the run measured no link rate (it ran on loopback)")
        gbit = data["link_bps"] / 1e9
        res = data["results"]
        if job is None and "compute-only" in res:
            compute = res["compute-only"]["step_s"]
            job = {"forward_s": compute / 3, "backward_s": 2 * compute / 3,
                   "grad_bytes": 4 * res["compute-only"]["params"], "samples_per_rank": 1, "tokens_per_sample": 128}
        for name, arm in _E2E_ARMS.items():
            if name in res:
                runs.append({"shape": [2, 2], "inter_gbit": round(gbit, 3), "intra_gbit": intra_gbit, "arm": arm,
                             "label": f"{name} at {gbit:.2f} Gbit/s", "step_s": res[name]["step_s"]})
    if job is None:
        raise SystemExit("no run has a compute-only arm: add --arms ...,compute-only to one of them")
    return {"job": job, "runs": runs}


def _job(figures: dict[str, Any], k: float) -> pj.JobFigures:
    f = dict(figures)
    f["bucket_bytes"] = pj.ddp_buckets(f.pop("grad_bytes")) if "grad_bytes" in f else tuple(f["bucket_bytes"])
    f["forward_s"], f["backward_s"] = f["forward_s"] * k, f["backward_s"] * k
    return pj.JobFigures(**f)


def predict(figures: dict[str, Any], run: dict[str, Any], k: float = 1.0) -> float:
    shape = run["shape"]
    links = pj.target_links(None, local_ranks=max(shape), inter_gbit=run["inter_gbit"], intra_gbit=run["intra_gbit"],
                            inter_latency_s=run.get("inter_latency_us", 100) * 1e-6,
                            intra_latency_s=run.get("intra_latency_us", 30) * 1e-6)
    speeds = tuple(run["speeds"]) if run.get("speeds") else None
    cluster = pj.Cluster(nodes=pj.uniform_nodes(shape), links=links, speeds=speeds, backend="gloo")
    row = pj.project(_job(figures, k), cluster, [run["arm"]], sync_every=run.get("sync_every", 50))[0]
    return row.step_s


def calibrate(figures: dict[str, Any], run: dict[str, Any]) -> float:
    """k such that the predicted step of ``run`` equals its measured step (the step grows with k)."""
    lo, hi = 0.0, 1.0
    while predict(figures, run, hi) < run["step_s"] and hi < 1e6:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(figures, run, mid) < run["step_s"] else (lo, mid)
    return (lo + hi) / 2


def _key(run: dict[str, Any]) -> str:
    """``arm@2x2@0.96g``: arm, ranks per node, the link between nodes in Gbit/s."""
    return f"{run['arm']}@{'x'.join(map(str, run['shape']))}@{run['inter_gbit']:g}g"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path, help="measurements JSON (default: from benchmarks/records/end_to_end.json)")
    p.add_argument("--calibrate", default=None, help="ARM@SHAPE of the calibration run (default: the first run)")
    p.add_argument("--intra-gbit", type=float, default=20.0, help="loopback inside an emulated node (default 20)")
    p.add_argument("--end-to-end", type=Path, nargs="+", metavar="DIR",
                   help="--out folders of benchmarks.end_to_end runs (e.g. at several --rate), one with compute-only")
    args = p.parse_args(argv)
    if args.end_to_end:
        data = from_end_to_end_runs(args.end_to_end, intra_gbit=args.intra_gbit)
    elif args.measured:
        data = json.loads(args.measured.read_text())
    else:
        data = from_end_to_end(intra_gbit=args.intra_gbit)
    runs = data["runs"]
    base = next((r for r in runs if _key(r) == args.calibrate), None) if args.calibrate else runs[0]
    if base is None:
        print(f"--calibrate={args.calibrate!r}: no such run; runs: {', '.join(map(_key, runs))}", file=sys.stderr)
        return 2
    k = calibrate(data["job"], base)
    print(f"calibrated on {_key(base)}: compute x {k:.3f} (measured {base['step_s'] * 1e3:.0f} ms)")
    print(f"{'run':<22} {'label':<28} {'measured ms':>11} {'predicted ms':>12} {'pred/meas':>9}")
    for r in runs:
        t = predict(data["job"], r, k)
        print(f"{_key(r):<22} {str(r.get('label', '')):<28} {r['step_s'] * 1e3:>11.0f} {t * 1e3:>12.0f} "
              f"{t / r['step_s']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
