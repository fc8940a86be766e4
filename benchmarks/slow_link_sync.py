"""Slow links: an unchanged DDP job learning real text, exact synchronization against MEMRT_SYNC=diloco.

Command (full: byte-level GPT d=384, 2 layers, ctx 64, 2 windows per rank per step, AdamW lr 1e-3, trained on
the Python standard library's source files with every 10th file held out; 2 nodes x 2 ranks of the emulated
cluster at --rate; needs root for the cluster, else loopback with ``MEMRT_TOPOLOGY="0,1;2,3"``, said in the
output; --quick: d=64, 1 layer, 12 steps, loopback, four arms):

    cd /work/main && sudo .venv/bin/python -m benchmarks.slow_link_sync [--quick] [--rate 1gbit] [--steps 600]
        [--stock-steps N] [--arms stock,memrt,...] [--out DIR] [--record]

Arms (each launches ``tests/scripts/train_bytes_lm.py``, which imports no memrt, on the same 4 ranks and the
same data): ``stock`` (DDP over gloo: the baseline of every ratio), ``memrt`` (``MEMRT=1``, exact),
``memrt-int8`` (``MEMRT_COMPRESS=int8``), ``post-local-sgd-H`` (torch's ``PostLocalSGDOptimizer`` +
``PeriodicModelAverager`` with period H and ``post_localSGD_hook`` per node: what a user of torch alone would
write), ``diloco-H`` (``MEMRT=1 MEMRT_SYNC=diloco MEMRT_SYNC_EVERY=H``), ``diloco-H-fK`` (the same with
``MEMRT_SYNC_FRAGMENTS=K``: K fragments streamed, each exchange overlapped with the next inner step).

Reported per arm: tokens/s of training (evaluation left out) and its ratio to stock; the eval loss on the
held-out files at the end and relative to stock's at the same step (``--stock-steps`` shorter than
``--steps``: at stock's last step, read from the arm's curve); the training seconds each arm needed to reach
stock's final eval loss and its speed-up over the best exact arm (memrt, memrt-int8) and over post-local SGD.
Plots: eval loss against tokens and against training seconds (``slow_link_sync.png``). ``--record`` also
writes a results record to benchmarks/records/.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks._common import (base_parser, exit_code, fail_line, failures, fmt_ratio, launch_on_nodes, machine_info,
                                machine_line, print_table, result_lines, save_plot, write_json, write_record)

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "train_bytes_lm.py"
NODES = ((0, 1), (2, 3))
MODEL = ["--d", "384", "--layers", "2", "--heads", "6", "--ctx", "64", "--batch", "2", "--eval-every", "100"]
QUICK_MODEL = ["--d", "64", "--layers", "1", "--heads", "2", "--ctx", "32", "--batch", "2", "--eval-every", "6",
               "--eval-windows", "16", "--corpus-bytes", "400000"]


def _arms(quick: bool) -> dict[str, tuple[list[str], dict[str, str]]]:
    arms: dict[str, tuple[list[str], dict[str, str]]] = {
        "stock": ([], {}), "memrt": ([], {"MEMRT": "1"}), "memrt-int8": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "int8"})}
    for h in ((6,) if quick else (10, 50)):
        arms[f"post-local-sgd-{h}"] = (["--post-local-sgd", str(h)], {})
    for h in ((3, 6) if quick else (10, 50, 200)):
        arms[f"diloco-{h}"] = ([], {"MEMRT": "1", "MEMRT_SYNC": "diloco", "MEMRT_SYNC_EVERY": str(h)})
    for h, k in (((6, 2),) if quick else ((50, 4), (200, 4))):  # streamed: K fragments, each overlapped with a step
        arms[f"diloco-{h}-f{k}"] = ([], {"MEMRT": "1", "MEMRT_SYNC": "diloco", "MEMRT_SYNC_EVERY": str(h),
                                         "MEMRT_SYNC_FRAGMENTS": str(k)})
    return arms


QUICK_ARMS = ("stock", "memrt", "post-local-sgd-6", "diloco-3")


def _run_arm(name: str, arms: dict, argv: list[str], cluster: Any, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    extra, env = arms[name]
    env = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_REPORT_DIR": str(out_dir / f"memrt-report-{name}"), **env}
    outs = launch_on_nodes(["python", str(SCRIPT), *argv, *extra], nodes=NODES, cluster=cluster, env=env,
                           timeout_s=timeout_s)
    res = result_lines(outs)[0]
    res["memrt_banner"] = any("memrt 0." in o + e and " on | launcher" in o + e for _, o, e in outs)
    res["sync_line"] = next((line for _, o, e in outs for line in (o + e).splitlines()
                             if line.startswith("memrt: sync diloco")), None)
    return res


def _loss_at(curve: list[list[float]], step: int) -> float | None:
    """The eval loss at ``step`` (linear between the curve's points), or None past its end."""
    for (s0, _, _, l0), (s1, _, _, l1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0) if s1 > s0 else l1
    return None


def _seconds_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at which the eval loss first reaches ``target`` (linear between points), else None."""
    for (_, _, t0, l0), (_, _, t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * ((l0 - target) / (l0 - l1) if l0 > l1 else 1.0)
    return None


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios against stock measured in the same run (see the module docstring)."""
    stock = results.get("stock")
    if stock is None:
        return {}
    target = stock["final_eval_loss"]
    for r in results.values():
        r["vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
        at = _loss_at(r["curve"], stock["steps"])
        r["loss_vs_stock"] = None if at is None else at / target - 1.0
        r["seconds_to_stock_loss"] = _seconds_to(r["curve"], target)
    def best(names: list[str]) -> float | None:
        times = [results[n]["seconds_to_stock_loss"] for n in names
                 if n in results and results[n]["seconds_to_stock_loss"] is not None]
        return min(times) if times else None
    exact = best(["memrt", "memrt-int8"])
    post = best([n for n in results if n.startswith("post-local-sgd")])
    for r in results.values():
        t = r["seconds_to_stock_loss"]
        r["speedup_vs_best_exact"] = exact / t if t and exact else None
        r["speedup_vs_post_local_sgd"] = post / t if t and post else None
    return {"stock_final_eval_loss": target, "best_exact_seconds": exact, "best_post_local_sgd_seconds": post}


def _plot(results: dict[str, dict[str, Any]]):
    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name, r in results.items():
            steps, tokens, seconds, loss = zip(*r["curve"])
            a.plot(tokens, loss, marker=".", label=name)
            b.plot(seconds, loss, marker=".", label=name)
        a.set_xlabel("tokens"), a.set_ylabel("eval loss (held-out files)"), a.legend(fontsize=7)
        b.set_xlabel("training seconds"), b.set_ylabel("eval loss"), b.legend(fontsize=7)
        fig.tight_layout()
    return draw


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--rate", default="1gbit", help="inter-node link rate of the emulated cluster")
    p.add_argument("--steps", type=int, default=None, help="training steps of every arm (default 600; quick 12)")
    p.add_argument("--stock-steps", type=int, default=None, help="stock's steps (default --steps)")
    p.add_argument("--arms", default=None, help="comma-separated subset (default: all; quick: "
                   + ",".join(QUICK_ARMS) + ")")
    p.add_argument("--record", action="store_true", help="also write a record to benchmarks/records/")
    args = p.parse_args(argv)
    from memrt.cluster import EmulatedCluster, can_emulate

    info = machine_info()
    print(machine_line(info), flush=True)
    out_dir = Path(args.out)
    arms = _arms(args.quick)
    names = args.arms.split(",") if args.arms else list(QUICK_ARMS if args.quick else arms)
    unknown = [a for a in names if a not in arms]
    if unknown:
        p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; expected a subset of {','.join(arms)}")
    steps = args.steps or (12 if args.quick else 600)
    model = QUICK_MODEL if args.quick else MODEL
    use_cluster, why = (False, "--quick") if args.quick else can_emulate()
    net = f"emulated 2 nodes x 2 ranks at {args.rate}" if use_cluster else f"loopback ({why}), MEMRT_TOPOLOGY=0,1;2,3"
    results: dict[str, dict[str, Any]] = {}
    timeout_s = 300 if args.quick else 3600
    with (EmulatedCluster(args.rate) if use_cluster else nullcontext()) as cluster:
        for name in names:
            n = args.stock_steps if name == "stock" and args.stock_steps else steps
            run_args = [*model, "--steps", str(n)]
            print(f"running {name} ({' '.join(run_args)}) on {net} ...", flush=True)
            try:
                res = _run_arm(name, arms, run_args, cluster, out_dir, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failing arm fails the benchmark
                fail_line(name, f"{type(exc).__name__}: {exc}")
                continue
            if name.startswith(("memrt", "diloco")) and not res["memrt_banner"]:
                fail_line(name, "no memrt banner in the ranks' output: this arm measured stock DDP")
            if name.startswith("diloco") and not res["sync_line"]:
                fail_line(name, "no 'memrt: sync diloco' line: MEMRT_SYNC=diloco did not attach")
            if not res["finite"]:
                fail_line(name, f"eval loss is not finite ({res['final_eval_loss']})")
            results[name] = res
            print(f"{name}: {res['tokens_per_s']:.0f} tokens/s, eval loss {res['final_eval_loss']:.4f} after "
                  f"{res['steps']} steps" + (f"\n  {res['sync_line']}" if res["sync_line"] else ""), flush=True)
    summary = summarize(results)
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['tokens_per_s']:.0f}", fmt_ratio(r.get("vs_stock")), str(r["steps"]),
                     f"{r['final_eval_loss']:.4f}",
                     f"{100 * r['loss_vs_stock']:+.2f}%" if r.get("loss_vs_stock") is not None else "-",
                     f"{r['seconds_to_stock_loss']:.1f}" if r.get("seconds_to_stock_loss") else "not reached",
                     fmt_ratio(r.get("speedup_vs_best_exact")), fmt_ratio(r.get("speedup_vs_post_local_sgd"))])
    headers = ["arm", "tokens/s", "vs stock", "steps", "eval loss", "vs stock at stock's steps",
               "s to stock's loss", "vs best exact", "vs post-local SGD"]
    title = f"byte-level GPT on stdlib source, 4 ranks, {net} (same run; baseline: stock)"
    print_table(headers, rows, title=title)
    payload = {"machine": info, "quick": args.quick, "network": net, "model_args": model, "steps": steps,
               "results": results, "summary": summary, "failed": failures()}
    write_json(out_dir, "slow_link_sync", payload)
    save_plot(out_dir, "slow_link_sync", _plot(results))
    if args.record and not args.quick and "stock" in results:
        best = max((n for n in results if n.startswith("diloco")), key=lambda n: results[n]["vs_stock"], default=None)
        if best is not None:
            r = results[best]
            detail = (f"{best}: {r['vs_stock']:.2f}x stock tokens/s, eval loss {100 * (r['loss_vs_stock'] or 0):+.2f}% "
                      f"at stock's steps; " + ", ".join(f"{n} {results[n]['vs_stock']:.2f}x" for n in results
                                                        if n != "stock"))
            write_record(f"slow_link_sync_{args.rate}", benchmark="slow_link_sync", topic="sync",
                         claim=f"MEMRT_SYNC=diloco, unchanged DDP job, 2 nodes x 2 ranks at {args.rate} ({net})",
                         figures={"detail": detail, "summary": f"{best} {r['vs_stock']:.2f}x stock"},
                         baseline="stock DDP, same run", info=info,
                         tables=[{"title": title, "headers": headers, "rows": rows}])
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
