"""End to end: an unchanged GPT-style DDP script on the emulated two-node cluster, stock vs MEMRT=1.

Command (full: GPT d=512, 4 layers, 1 x 128 tokens per rank, 2 nodes x 2 ranks at 1 Gbit/s, 200 steps;
needs root for the emulated cluster, else it runs on loopback with ``MEMRT_TOPOLOGY="0,1;2,3"`` and says so;
--quick: d=128, 2 layers, 12 steps, loopback, < 60 s):

    cd /work/main && .venv/bin/python -m benchmarks.end_to_end [--quick] [--rate 1gbit] [--steps 200]
        [--arms stock,compute-only,comm-only,memrt,memrt-int8] [--out DIR]

Arms (each launches ``tests/scripts/train_gpt_ddp.py``, which imports no memrt, on the same 4 ranks):
``stock`` (DDP over gloo: the baseline of every ratio), ``compute-only`` (the same ranks training at the
same time with no communication: the bound), ``comm-only`` (one all_reduce of the gradients' size per
step), ``memrt`` (``MEMRT=1``, exact) and ``memrt-int8`` (``MEMRT=1 MEMRT_COMPRESS=int8``, error feedback).
Reported per arm: tokens/s, ratio vs stock, share of the compute-only bound, peak RSS, loss after N steps
and its difference from stock; plus the config's compute/communication split. Goals of issue 9: memrt
>= 1.3x stock; int8 >= 2x stock and >= 85% of the compute-only bound, loss within 1% of stock.
"""

from __future__ import annotations

import re
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks._common import (base_parser, exit_code, fail_line, failures, fmt_ratio, launch_ranks, machine_info,
                                machine_line, print_table, result_lines, save_plot, write_json)

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "train_gpt_ddp.py"
NODES = ((0, 1), (2, 3))
ARMS = {
    "stock": ([], {}),
    "compute-only": (["--no-comm"], {}),
    "comm-only": (["--comm-only"], {}),
    "memrt": ([], {"MEMRT": "1"}),
    "memrt-int8": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "int8"}),
}
_BANNER = re.compile(r"^memrt \S+ on \|", re.MULTILINE)


def _run_arm(name: str, model_args: list[str], cluster: Any, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    extra, env = ARMS[name]
    env = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_REPORT_DIR": str(out_dir / f"memrt-report-{name}"), **env}
    outs = launch_ranks(["python", str(SCRIPT), *model_args, *extra], nodes=NODES, cluster=cluster, env=env,
                        timeout_s=timeout_s)
    res = result_lines(outs)[0]
    res["memrt_banner"] = any(_BANNER.search(o + e) for _, o, e in outs)
    return res


def _memrt_missing() -> str | None:
    try:
        import memrt.activation.autoload  # noqa: F401
        import memrt.comm  # noqa: F401
    except Exception as exc:
        return f"MEMRT=1 activation not available yet ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--rate", default="1gbit", help="inter-node link rate of the emulated cluster")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; quick 12)")
    p.add_argument("--arms", default=",".join(ARMS), help="subset of " + ",".join(ARMS))
    p.add_argument("--loopback", action="store_true", help="do not build the emulated cluster")
    args = p.parse_args(argv)
    info = machine_info()
    print(machine_line(info), flush=True)
    steps = args.steps or (12 if args.quick else 200)
    model_args = ["--steps", str(steps), "--warmup", "3" if args.quick else "10"]
    model_args += ["--d-model", "128", "--layers", "2"] if args.quick else ["--d-model", "512", "--layers", "4"]
    model_args += ["--seq", "128", "--batch", "1"]
    out_dir = Path(args.out)
    from memrt.cluster import EmulatedCluster, can_emulate

    ok, why = can_emulate()
    use_cluster = ok and not args.quick and not args.loopback
    net = f"emulated 2 nodes, {args.rate}" if use_cluster else "loopback (MEMRT_TOPOLOGY=0,1;2,3)"
    if not use_cluster:
        print(f"# network: loopback, not the emulated cluster ({'--quick' if args.quick else '--loopback' if args.loopback else why}); "
              "the inter-node link is not rate-limited, so communication matters less", flush=True)
    arms = args.arms.split(",")
    missing = _memrt_missing()
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    timeout_s = 300 if args.quick else 1800
    with (EmulatedCluster(args.rate) if use_cluster else nullcontext()) as cluster:
        for arm in arms:
            if arm.startswith("memrt") and missing:
                fail_line(arm, missing)
                continue
            print(f"running {arm} ({' '.join(model_args)}) on {net} ...", flush=True)
            try:
                results[arm] = _run_arm(arm, model_args, cluster, out_dir, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failing arm fails the benchmark
                fail_line(arm, f"{type(exc).__name__}: {exc}")
                continue
            write_json(out_dir, "end_to_end.partial", {"machine": info, "network": net, "model_args": model_args,
                                                      "results": results, "skipped": skipped})
            if arm.startswith("memrt") and not results[arm]["memrt_banner"]:
                fail_line(arm, "no memrt banner in the ranks' output: memrt did not switch on, "
                          "this arm measured stock DDP")
    summary = _summarize(results)
    rows = []
    for arm, r in results.items():
        rows.append([arm, f"{r['tokens_per_s']:.0f}", f"{r['step_s'] * 1e3:.0f}", fmt_ratio(r.get("vs_stock")),
                     f"{100 * r['of_bound']:.0f}%" if r.get("of_bound") is not None else "-",
                     f"{r['peak_rss_mib']:.0f}", f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                     f"{100 * r['loss_vs_stock']:+.2f}%" if r.get("loss_vs_stock") is not None else "-",
                     ("yes" if r["memrt_banner"] else "NO") if arm.startswith("memrt") else "-"])
    print_table(["arm", "tokens/s", "step ms", "vs stock", "of compute bound", "peak RSS MiB", f"loss@{steps}",
                 "loss vs stock", "memrt on"], rows,
                title=f"GPT {' '.join(model_args[4:])}, 4 ranks, {net} (same run; baseline: stock)")
    if summary.get("split"):
        s = summary["split"]
        print(f"compute/communication split: compute-only step {s['compute_s'] * 1e3:.0f} ms, "
              f"gradient all_reduce alone {s['comm_s'] * 1e3:.0f} ms, stock step {s['stock_s'] * 1e3:.0f} ms "
              f"-> comm share of stock step {100 * s['comm_share_of_stock']:.0f}%, stock at "
              f"{100 * s['stock_of_bound']:.0f}% of the compute-only bound", flush=True)
    goals = _goals(results)
    for g in goals:
        print(f"goal {g['goal']}: {g['status']} ({g['value']})")
    write_json(out_dir, "end_to_end", {"machine": info, "quick": args.quick, "network": net,
                                      "model_args": model_args, "results": results, "skipped": skipped,
                                      "summary": summary, "goals": goals, "failed": failures()})
    save_plot(out_dir, "end_to_end", _plot(results))
    return exit_code()


def _summarize(results: dict[str, Any]) -> dict[str, Any]:
    stock, bound = results.get("stock"), results.get("compute-only")
    for r in results.values():
        if stock:
            r["vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
            if r["final_loss"] is not None and stock["final_loss"]:
                r["loss_vs_stock"] = r["final_loss"] / stock["final_loss"] - 1
        if bound:
            r["of_bound"] = r["tokens_per_s"] / bound["tokens_per_s"]
    out: dict[str, Any] = {}
    if stock and bound and "comm-only" in results:
        comm = results["comm-only"]["step_s"]
        out["split"] = {"compute_s": bound["step_s"], "comm_s": comm, "stock_s": stock["step_s"],
                        "comm_share_of_stock": max(0.0, 1 - bound["step_s"] / stock["step_s"]),
                        "stock_of_bound": bound["step_s"] / stock["step_s"]}
    return out


def _goals(results: dict[str, Any]) -> list[dict[str, str]]:
    def check(name, arm, key, op, target, fmt):
        r = results.get(arm)
        if r is None or r.get(key) is None:
            return {"goal": name, "status": "not measured", "value": "-"}
        v = r[key]
        met = v >= target if op == ">=" else abs(v) <= target
        return {"goal": name, "status": "met" if met else "NOT met", "value": fmt(v)}

    return [check("memrt exact >= 1.3x stock tokens/s", "memrt", "vs_stock", ">=", 1.3, fmt_ratio),
            check("int8 >= 2x stock tokens/s", "memrt-int8", "vs_stock", ">=", 2.0, fmt_ratio),
            check("int8 >= 85% of compute-only bound", "memrt-int8", "of_bound", ">=", 0.85, lambda v: f"{100 * v:.0f}%"),
            check("int8 loss within 1% of stock", "memrt-int8", "loss_vs_stock", "abs<=", 0.01,
                  lambda v: f"{100 * v:+.2f}%")]


def _plot(results: dict[str, Any]):
    def draw(plt):
        names = [a for a in results if a != "comm-only"]
        plt.bar(names, [results[a]["tokens_per_s"] for a in names],
                color=["tab:red" if a.startswith("memrt") else "tab:gray" for a in names])
        plt.ylabel("tokens/s (4 ranks)")
        plt.title("end to end: unchanged DDP script, stock vs MEMRT=1")
    return draw


if __name__ == "__main__":
    sys.exit(main())
