"""``memrt project REPORT_DIR --nodes N --ranks-per-node G``: a job's step time on bigger clusters, per arm.

The figures of one finished run come from its report folder (``MEMRT_REPORT_DIR`` of a ``MEMRT=1`` run):
each rank's step split (``meta.activation.step``: forward, backward (compute, up to the last gradient),
optimizer, data, other; in reports without ``grad_wait`` the backward's waits for the last buckets are taken
out with :func:`memrt.comm.projection.backward_compute`), the gradient
all-reduces of one step (``comm`` records: each bucket's bytes and measured seconds), the batch per rank
(the balancer's shares) and the links memrt.comm's probe measured (``meta.activation.links``, else the probe's
``comm-links-*.json`` cached in the same folder). Any figure can be given instead (``--forward-s``, ...,
``--inter-gbit``), and without REPORT_DIR all of them are. The model is :mod:`memrt.comm.projection`; every
collective's time is :func:`memrt.comm.costmodel.predict`'s. docs/sections/projection.md describes it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memrt.errors import MemrtError

__all__ = ["add_arguments", "run", "report_figures", "rows"]

_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _numbers(option: str, text: str | None, kind=float, zero: bool = False) -> list | None:
    """``text`` as a comma list of numbers > 0 (>= 0 with ``zero``), or MemrtError naming ``option``."""
    if text is None:
        return None
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not (math.isfinite(v) and (v >= 0 if zero else v > 0)) for v in values):
        what = "whole numbers" if kind is int else "numbers"
        raise MemrtError(f"{option}={text!r} is not valid: expected {what} {'>=' if zero else '>'} 0, comma-separated")
    return values


def _one(option: str, text: str | None, zero: bool = False) -> float | None:
    values = _numbers(option, text, float, zero)
    if values is not None and len(values) != 1:
        raise MemrtError(f"{option}={text!r} is not valid: expected one number")
    return values[0] if values else None


def _step_records(comm: list[dict[str, Any]], world: int, steps: int) -> tuple[list[float], list[float]]:
    """(bucket bytes, mean measured seconds) of one step's gradient all-reduces: the world-wide float all-reduces,
    ``k`` per step, positions averaged over the steps after the first (the last ``k`` give the sizes)."""
    calls = sorted((r for r in comm if r.get("op") == "all_reduce" and r.get("dtype", "float32") in _FLOAT_DTYPES
                    and r.get("group_size", world) == world and r.get("nbytes", 0) > 8),
                   key=lambda r: r.get("start") or 0.0)
    if not calls or steps < 1:
        return [], []
    k = max(1, round(len(calls) / steps))
    rounds = [calls[len(calls) - k * (i + 1):len(calls) - k * i] for i in range(min(steps - 1, len(calls) // k) or 1)]
    sizes = [float(r["nbytes"]) for r in rounds[0]]
    seconds = [statistics.fmean(float(rd[j]["seconds"]) for rd in rounds) for j in range(k)]
    return sizes, seconds


def _links_in(directory: Path, metas: list[dict[str, Any]]):
    from memrt.comm.costmodel import LinkModel

    for meta in metas:
        if isinstance(meta.get("links"), dict):
            try:
                return LinkModel.from_json(json.dumps(meta["links"]))
            except (TypeError, ValueError, KeyError):
                pass
    for path in sorted(directory.glob("comm-links-*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            return LinkModel.from_json(path.read_text())
        except (OSError, TypeError, ValueError, KeyError):
            continue
    return None


def report_figures(directory: str | Path) -> dict[str, Any]:
    """What a run's report folder says about its step: ``forward_s``, ``backward_s`` (compute only), ``optimizer_s``,
    ``other_s``, ``bucket_bytes``, ``element_size``, ``samples_per_rank``, ``links`` (LinkModel or None),
    ``measured_local`` (ranks per node measured), ``sync_every``, ``world_size``, ``measured_step_s``
    (missing figures are absent). Raises MemrtError for a folder without a memrt report."""
    from memrt.comm.projection import backward_compute
    from memrt.profiling.rankfiles import load_rank_files

    path = Path(directory)
    if not path.is_dir():
        raise MemrtError(f"REPORT_DIR {str(path)!r} is not a folder: give the MEMRT_REPORT_DIR of a finished run")
    ranks, problems = load_rank_files(path)
    if not ranks:
        why = "; ".join(map(str, problems)) if problems else "no rank*.json files in it"
        raise MemrtError(f"REPORT_DIR {str(path)!r} holds no memrt report ({why})")
    metas = [(d.get("meta") or {}).get("activation") or {} for d in ranks]
    out: dict[str, Any] = {"world_size": max(int(m.get("world_size") or 1) for m in metas)}
    steps = [m["step"] for m in metas if isinstance(m.get("step"), dict)]
    world = out["world_size"]
    sizes, seconds = [], []
    if steps:
        n_steps = int(steps[0].get("steps") or 1)
        per_rank = [_step_records(d.get("comm") or [], world, n_steps) for d in ranks]
        sizes = per_rank[0][0]
        if sizes and all(len(s) == len(sizes) for s, _ in per_rank):
            seconds = [statistics.fmean(t[j] for _, t in per_rank) for j in range(len(sizes))]
        mean = {k: statistics.fmean(float(s.get(k) or 0.0) for s in steps)
                for k in ("forward", "backward", "optimizer", "data", "other", "step")}
        if all("grad_wait" in s for s in steps):  # the clock marks the last gradient: backward is compute only
            backward = mean["backward"]
        else:  # an older report: the backward holds the waits for the last buckets, estimated and taken out
            backward = backward_compute(mean["backward"], sizes, seconds) if seconds else mean["backward"]
        out.update(forward_s=mean["forward"], optimizer_s=mean["optimizer"], other_s=mean["data"] + mean["other"],
                   measured_step_s=mean["step"], backward_s=backward)
    if sizes:
        out["bucket_bytes"] = tuple(sizes)
        dtypes = [r.get("dtype") for r in ranks[0].get("comm") or [] if r.get("op") == "all_reduce"]
        out["element_size"] = _SIZES.get(dtypes[-1] if dtypes else "float32", 4)
    params = [int(x.get("parameters") or 0) for m in metas for x in (m.get("models") or []) if isinstance(x, dict)]
    if params and max(params) > 0:
        out["param_bytes"] = 4.0 * max(params)
    shares = ((metas[0].get("balance") or {}).get("shares") if isinstance(metas[0].get("balance"), dict) else None)
    if isinstance(shares, list) and shares and all(isinstance(s, (int, float)) and s > 0 for s in shares):
        out["samples_per_rank"] = statistics.fmean(shares)
    out["links"] = _links_in(path, metas)
    nodes = metas[0].get("nodes")
    out["measured_local"] = max(len(n) for n in nodes) if isinstance(nodes, list) and nodes else 1
    every = ((metas[0].get("config") or {}).get("MEMRT_SYNC_EVERY") or {}).get("value")
    if isinstance(every, int) and every > 0:
        out["sync_every"] = every
    return out


def _job(args: argparse.Namespace, found: dict[str, Any]):
    from memrt.comm.projection import JobFigures, ddp_buckets

    given = {"forward_s": _one("--forward-s", args.forward_s, zero=True),
             "backward_s": _one("--backward-s", args.backward_s, zero=True),
             "optimizer_s": _one("--optimizer-s", args.optimizer_s, zero=True),
             "other_s": _one("--other-s", args.other_s, zero=True),
             "param_bytes": _one("--param-bytes", args.param_bytes),
             "samples_per_rank": _one("--samples-per-rank", args.samples_per_rank),
             "tokens_per_sample": _one("--tokens-per-sample", args.tokens_per_sample)}
    grad = _one("--grad-bytes", args.grad_bytes)
    figures = {k: v for k, v in found.items() if k in given or k in ("bucket_bytes", "element_size")}
    figures.update({k: v for k, v in given.items() if v is not None})
    if grad is not None:
        figures["bucket_bytes"] = ddp_buckets(grad)
    for key, option, what in (("forward_s", "--forward-s", "step times (a MEMRT=1 run that stepped writes them)"),
                              ("backward_s", "--backward-s", "step times (a MEMRT=1 run that stepped writes them)"),
                              ("bucket_bytes", "--grad-bytes", "gradient all-reduces (a DDP run writes them)")):
        if key not in figures:
            raise MemrtError(f"{option}: the report holds no {what}; give {option}" if args.report_dir else
                             f"{option}: needed without REPORT_DIR (or give the report folder of a run)")
    try:
        return JobFigures(**figures)
    except ValueError as exc:
        raise MemrtError(str(exc)) from None


def _shapes(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """Ranks per node of each cluster projected to."""
    per_node = _numbers("--ranks-per-node", args.ranks_per_node or "1", int)
    nodes = _numbers("--nodes", args.nodes, int)
    if len(per_node) > 1:  # uneven nodes: one shape
        if nodes is not None and nodes != [len(per_node)]:
            raise MemrtError(f"--nodes={args.nodes!r} does not match --ranks-per-node={args.ranks_per_node!r} "
                             f"({len(per_node)} nodes): give one or the other")
        return [tuple(per_node)]
    if nodes is None:
        raise MemrtError("--nodes: give the number of nodes to project to (e.g. --nodes 8 or --nodes 8,64,512)")
    return [(per_node[0],) * n for n in nodes]


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The projection of ``args`` (the command's options) as JSON-ready rows, one per (link, nodes, arm)."""
    from memrt.comm import projection as pj

    shapes = _shapes(args)
    arms = [a.strip() for a in (args.arms or ",".join(pj.ARMS)).split(",") if a.strip()]
    bad = [a for a in arms if a not in pj.ARMS]
    if bad or not arms:
        raise MemrtError(f"--arms: {bad[0] if bad else args.arms!r} is not an arm: expected some of {', '.join(pj.ARMS)}")
    every = _numbers("--sync-every", args.sync_every, int)
    speeds = _numbers("--rank-speeds", args.rank_speeds)
    gbits = _numbers("--inter-gbit", args.inter_gbit) or [None]
    for option, value in (("--intra-gbit", args.intra_gbit), ("--inter-latency-us", args.inter_latency_us),
                          ("--intra-latency-us", args.intra_latency_us)):
        _one(option, value, zero=option.endswith("-us"))
    if args.backend not in ("nccl", "gloo"):
        raise MemrtError(f"--backend={args.backend!r} is not valid: expected nccl or gloo")
    found = report_figures(args.report_dir) if args.report_dir else {}
    job = _job(args, found)
    sync_every = every[0] if every else found.get("sync_every", 50)
    out = []
    for gbit in gbits:
        for shape in shapes:
            nodes = pj.uniform_nodes(shape)
            try:
                links = pj.target_links(found.get("links"), local_ranks=max(shape),
                                        measured_local=found.get("measured_local", 1), inter_gbit=gbit,
                                        intra_gbit=_one("--intra-gbit", args.intra_gbit),
                                        inter_latency_s=_us("--inter-latency-us", args.inter_latency_us),
                                        intra_latency_s=_us("--intra-latency-us", args.intra_latency_us))
            except ValueError as exc:
                raise MemrtError(str(exc)) from None
            if len(shape) > 1 and links.inter is None:
                raise MemrtError("--inter-gbit: the report measured no link across nodes (a run on one node); give "
                                 "the link between nodes")
            p = sum(shape)
            tiled = tuple(speeds[i % len(speeds)] for i in range(p)) if speeds else None
            cluster = pj.Cluster(nodes=nodes, links=links, speeds=tiled, backend=args.backend)
            used = 8 / (links.inter.beta_s_per_byte * 1e9) if links.inter and links.inter.beta_s_per_byte else None
            for r in pj.project(job, cluster, arms, sync_every=sync_every):
                out.append({**asdict(r), "ranks_per_node": list(shape) if len(set(shape)) > 1 else shape[0],
                            "inter_gbit": used, "sync_every": sync_every if r.arm == "diloco" else None})
    return out


def _us(option: str, text: str | None) -> float | None:
    v = _one(option, text, zero=True)
    return None if v is None else v * 1e-6


def _table(data: list[dict[str, Any]]) -> str:
    head = (f"{'nodes':>5} {'ranks':>6} {'inter Gbit/s':>12} {'arm':<7} {'step ms':>9} {'compute ms':>10} "
            f"{'comm ms':>9} {'exposed ms':>10} {'samples/s':>10} {'tokens/s':>10} {'vs stock':>8}")
    lines = [head]
    for r in data:
        def num(x: Any, f: str) -> str:
            return "-" if x is None else format(x, f)

        lines.append(f"{r['nodes']:>5} {r['ranks']:>6} {num(r['inter_gbit'], '.3g'):>12} {r['arm']:<7} "
                     f"{r['step_s'] * 1e3:>9.1f} {r['compute_s'] * 1e3:>10.1f} {r['comm_s'] * 1e3:>9.1f} "
                     f"{r['comm_exposed_s'] * 1e3:>10.1f} {num(r['samples_per_s'], '.0f'):>10} "
                     f"{num(r['tokens_per_s'], '.0f'):>10} {num(r['speedup_vs_stock'], '.2f'):>7}x")
    return "\n".join(lines)


def _plot(data: list[dict[str, Any]], path: str) -> None:
    from memrt.profiling.plots import PLOT_INSTALL_HINT, have_matplotlib

    if not have_matplotlib():
        raise MemrtError(f"--plot: matplotlib is not installed ({PLOT_INSTALL_HINT})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["arm"], r["inter_gbit"]) for r in data):
        pts = sorted((r["nodes"], r["speedup_vs_stock"]) for r in data if (r["arm"], r["inter_gbit"]) == key)
        label = key[0] + (f" @ {key[1]:.3g} Gbit/s" if key[1] else "")
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted speed-up over stock DDP")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise MemrtError(f"--plot: cannot write {path!r} ({exc})") from None
    finally:
        plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report_dir", nargs="?", default=None, metavar="REPORT_DIR",
                        help="report folder of a finished MEMRT=1 run (MEMRT_REPORT_DIR); optional when every figure "
                             "is given below")
    parser.add_argument("--nodes", help="nodes to project to; a comma list projects to each (8,64,512)")
    parser.add_argument("--ranks-per-node", help="ranks per node (default 1); a comma list gives each node's (4,4,2)")
    parser.add_argument("--inter-gbit", help="link between nodes, Gbit/s per node (shared by its ranks); a comma list "
                                             "projects to each (default: the report's measured link)")
    parser.add_argument("--intra-gbit", help="link between ranks of a node, Gbit/s per flow (default: measured)")
    parser.add_argument("--inter-latency-us", help="latency per message between nodes, microseconds (default: "
                                                   "measured, else 10)")
    parser.add_argument("--intra-latency-us", help="latency per message inside a node, microseconds (default: "
                                                   "measured, else 2)")
    parser.add_argument("--arms", help="comma list of stock, memrt, bf16, int8, diloco, fsdp2 (default: all)")
    parser.add_argument("--sync-every", help="diloco's H: steps between outer steps (default: the run's "
                                             "MEMRT_SYNC_EVERY, else 50)")
    parser.add_argument("--rank-speeds", help="relative speed of each rank (1 = the measured rank; 0.5 = half as "
                                              "fast), comma list in rank order; a shorter list repeats")
    parser.add_argument("--forward-s", help="forward compute per step, seconds (default: the report's)")
    parser.add_argument("--backward-s", help="backward compute per step without comm waits, seconds (default: the "
                                             "report's)")
    parser.add_argument("--optimizer-s", help="optimizer step, seconds (default: the report's, else 0)")
    parser.add_argument("--other-s", help="data loading and other time per step, seconds (default: the report's, "
                                          "else 0)")
    parser.add_argument("--grad-bytes", help="gradient bytes per step per rank, bucketed as DDP does (default: the "
                                             "report's buckets)")
    parser.add_argument("--param-bytes", help="float32 parameter bytes (diloco's outer step, FSDP2's all-gathers; "
                                              "default: the report's model, else the gradients')")
    parser.add_argument("--samples-per-rank", help="samples per rank per step (default: the report's batch)")
    parser.add_argument("--tokens-per-sample", help="tokens per sample, for tokens/s")
    parser.add_argument("--backend", default="nccl", help="the backend's reduce-scatter for fsdp2: nccl (ring, "
                                                          "default) or gloo")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per (link, nodes, arm)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a PNG of the speed-up over stock against nodes")


def run(args: argparse.Namespace) -> int:
    data = rows(args)
    if args.plot:
        _plot(data, args.plot)
    print(json.dumps(data, indent=1) if args.json else _table(data))
    if args.plot and not args.json:
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
