"""End to end: an unchanged GPT-style DDP script on the emulated two-node cluster: stock, the DDP comm
hooks torch ships, and MEMRT=1 (exact and with each codec), all in one run.

Command (full: GPT d=512, 4 layers, tied embeddings, vocabulary 1024 with every input from 64 of its
tokens, 1 x 128 tokens per rank, AdamW, 2 nodes x 2 ranks at 1 Gbit/s, 200 steps; needs root for the
emulated cluster, else it runs on loopback with ``MEMRT_TOPOLOGY="0,1;2,3"`` and says so; --quick: d=128,
2 layers, 12 steps, loopback, a few arms):

    cd /work/main && sudo .venv/bin/python -m benchmarks.end_to_end [--quick] [--rate 1gbit] [--steps 200]
        [--arms stock,compute-only,...] [--out DIR]

Arms (each launches ``tests/scripts/train_gpt_ddp.py``, which imports no memrt, on the same 4 ranks):
``stock`` (DDP over gloo: the baseline of every ratio), ``compute-only`` (the same ranks training at the
same time with no communication: the bound), ``comm-only`` (one all_reduce of the gradients' size per
step), ``torch-fp16`` / ``torch-bf16`` (DDP with torch's ``fp16_compress_hook`` / ``bf16_compress_hook``,
no memrt), ``torch-powersgd-r1`` / ``-r4`` (torch's ``powerSGD_hook``, rank 1 / 4, warm start, error
feedback, compressing from step 2, with DDP in one bucket: with several buckets the hook fails on gloo,
see below), ``memrt`` (``MEMRT=1``, exact), ``memrt-bf16`` / ``-fp16`` / ``-int8`` / ``-auto``
(``MEMRT_COMPRESS=...``: the inter-node hop of the gradients compressed, int8 with error feedback per
bucket). An arm that cannot run prints its row with the measured error.

torch's ``powerSGD_hook`` issues its P all-reduce, and waits for it, inside a future callback (then Q
in the next one); with several DDP buckets in flight those callbacks run on different threads in a
different order on each rank, and gloo, which pairs operations by issue order, aborts on 4 ranks
("op.preamble.length <= op.nbytes. 64 vs 32 ... collective mismatch") or hangs on 2 (measured on loopback
with several buckets; one bucket runs). The PowerSGD arms therefore use ``--bucket-cap-mb 1024`` (one
bucket, no overlap of backward and communication): the only set-up in which torch's hook runs on gloo.

Reported per arm: tokens/s, ratio vs stock, share of the compute-only bound, share of the serial link bound,
peak RSS, loss after N steps and its difference from stock; plus the compute/communication split, and the
targets: memrt exact >= 1.3x stock; memrt bf16 and fp16 >= 1.2x torch's fp16 hook; int8 >= 2x stock, ahead of
PowerSGD at equal or better loss, loss within 1% of stock. A missed target prints by how much, and the ratio
the serial link bound allows on this machine.

The serial link bound of an arm: the compute-only step plus the time the bytes one node sends across the
link per step take at the link rate measured at the start (a TCP stream through the emulated link). memrt
arms: the inter-node bytes their comm log recorded (node 0's ranks, per step); stock, comm-only and torch's
fp16 hook: the flat ring's (:func:`memrt.comm.select.tier_bytes`, fp16: half the bytes). An arm can beat it
only by overlapping backward and communication, which needs idle cores: the compute-only arm's "cores busy"
says how many it leaves.
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks._common import (base_parser, exit_code, fail_line, failures, fmt_ratio, launch_on_nodes, machine_info,
                                machine_line, print_table, result_lines, save_plot, write_json)

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "train_gpt_ddp.py"
NODES = ((0, 1), (2, 3))
ONE_BUCKET = ["--bucket-cap-mb", "1024"]
ARMS = {
    "stock": ([], {}),
    "compute-only": (["--no-comm"], {}),
    "comm-only": (["--comm-only"], {}),
    "torch-fp16": (["--hook", "fp16"], {}),
    "torch-bf16": (["--hook", "bf16"], {}),
    "torch-powersgd-r1": (["--hook", "powersgd", "--powersgd-rank", "1", *ONE_BUCKET], {}),
    "torch-powersgd-r4": (["--hook", "powersgd", "--powersgd-rank", "4", *ONE_BUCKET], {}),
    "memrt": ([], {"MEMRT": "1"}),
    "memrt-bf16": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "bf16"}),
    "memrt-fp16": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "fp16"}),
    "memrt-int8": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "int8"}),
    "memrt-auto": ([], {"MEMRT": "1", "MEMRT_COMPRESS": "auto"}),
}
QUICK_ARMS = ("stock", "torch-fp16", "torch-bf16", "torch-powersgd-r1", "memrt", "memrt-int8")
_BANNER = re.compile(r"^memrt \S+ on \|", re.MULTILINE)


def _run_arm(name: str, model_args: list[str], cluster: Any, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    extra, env = ARMS[name]
    env = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_REPORT_DIR": str(out_dir / f"memrt-report-{name}"), **env}
    outs = launch_on_nodes(["python", str(SCRIPT), *model_args, *extra], nodes=NODES, cluster=cluster, env=env,
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
    p.add_argument("--arms", default=None, help="subset of " + ",".join(ARMS) + " (default: all; quick: "
                   + ",".join(QUICK_ARMS) + ")")
    p.add_argument("--loopback", action="store_true", help="do not build the emulated cluster")
    args = p.parse_args(argv)
    info = machine_info()
    print(machine_line(info), flush=True)
    steps = args.steps or (12 if args.quick else 200)
    model_args = ["--steps", str(steps), "--warmup", "3" if args.quick else "10"]
    model_args += ["--d-model", "128", "--layers", "2"] if args.quick else ["--d-model", "512", "--layers", "4"]
    model_args += ["--seq", "128", "--batch", "1", "--vocab", "1024", "--subset", "64"]
    out_dir = Path(args.out)
    from memrt.cluster import EmulatedCluster, can_emulate

    ok, why = can_emulate()
    use_cluster = ok and not args.quick and not args.loopback
    net = f"emulated 2 nodes, {args.rate}" if use_cluster else "loopback (MEMRT_TOPOLOGY=0,1;2,3)"
    if not use_cluster:
        print(f"# network: loopback, not the emulated cluster ({'--quick' if args.quick else '--loopback' if args.loopback else why}); "
              "the inter-node link is not rate-limited, so communication matters less", flush=True)
    arms = args.arms.split(",") if args.arms else list(QUICK_ARMS if args.quick else ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown arm(s) {', '.join(unknown)}; expected a subset of {','.join(ARMS)}")
    missing = _memrt_missing()
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    timeout_s = 300 if args.quick else 1800
    with (EmulatedCluster(args.rate) if use_cluster else nullcontext()) as cluster:
        link_bps = cluster.measure_rate(seconds=2.0) if cluster is not None else None
        if link_bps is not None:
            print(f"link rate measured: {link_bps / 1e9:.3f} Gbit/s", flush=True)
        for arm in arms:
            if arm.startswith("memrt") and missing:
                fail_line(arm, missing)
                continue
            print(f"running {arm} ({' '.join(model_args)}) on {net} ...", flush=True)
            try:
                res = _run_arm(arm, model_args, cluster, out_dir, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failing arm fails the benchmark
                if arm.startswith("torch-"):  # torch's hook cannot run here: the row says why
                    skipped[arm] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{arm}: cannot run ({skipped[arm]})", flush=True)
                else:
                    fail_line(arm, f"{type(exc).__name__}: {exc}")
                continue
            if "error" in res:
                skipped[arm] = res["error"]
                print(f"{arm}: cannot run ({res['error']})", flush=True)
                continue
            results[arm] = res
            write_json(out_dir, "end_to_end.partial", {"machine": info, "network": net, "model_args": model_args,
                                                      "results": results, "skipped": skipped})
            if arm.startswith("memrt") and not results[arm]["memrt_banner"]:
                fail_line(arm, "no memrt banner in the ranks' output: memrt did not switch on, "
                          "this arm measured stock DDP")
    summary = _summarize(results, out_dir, link_bps)
    rows = []
    for arm, r in results.items():
        rows.append([arm, f"{r['tokens_per_s']:.0f}", f"{r['step_s'] * 1e3:.0f}", fmt_ratio(r.get("vs_stock")),
                     f"{100 * r['of_bound']:.0f}%" if r.get("of_bound") is not None else "-",
                     f"{r['serial_bound_s'] * 1e3:.0f} ms ({100 * r['of_serial_bound']:.0f}%)"
                     if r.get("serial_bound_s") else "-",
                     _cpu_cell(r), f"{r['peak_rss_mib']:.0f}",
                     f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                     f"{100 * r['loss_vs_stock']:+.2f}%" if r.get("loss_vs_stock") is not None else "-",
                     ("yes" if r["memrt_banner"] else "NO") if arm.startswith("memrt") else "-"])
    for arm, why in skipped.items():
        rows.append([arm, "-", "-", "-", "-", "-", "-", "-", "-", "-", f"cannot run: {why}"])
    print_table(["arm", "tokens/s", "step ms", "vs stock", "of compute bound", "serial link bound (of it)",
                 "CPU s/step (cores busy)",
                 "peak RSS MiB", f"loss@{steps}",
                 "loss vs stock", "memrt on / note"], rows,
                title=f"GPT {' '.join(model_args[4:])}, 4 ranks, {net} (same run; baseline: stock)")
    if summary.get("split"):
        s = summary["split"]
        print(f"compute/communication split: compute-only step {s['compute_s'] * 1e3:.0f} ms, "
              f"gradient all_reduce alone {s['comm_s'] * 1e3:.0f} ms, stock step {s['stock_s'] * 1e3:.0f} ms "
              f"-> comm share of stock step {100 * s['comm_share_of_stock']:.0f}%, stock at "
              f"{100 * s['stock_of_bound']:.0f}% of the compute-only bound"
              + (f"; compute alone keeps {s['compute_cores_busy']:.2f} cores busy"
                 if s.get("compute_cores_busy") else ""),
              flush=True)
    goals = _goals(results)
    for g in goals:
        print(f"target {g['goal']}: {g['status']} ({g['value']})")
    write_json(out_dir, "end_to_end", {"machine": info, "quick": args.quick, "network": net, "link_bps": link_bps,
                                      "model_args": model_args, "results": results, "skipped": skipped,
                                      "summary": summary, "goals": goals, "failed": failures()})
    save_plot(out_dir, "end_to_end", _plot(results))
    return exit_code()


def _cpu_cell(r: dict[str, Any]) -> str:
    """CPU seconds per step summed over the ranks, and the cores that kept busy (CPU / wall): near the
    machine's core count, an arm is bound by the CPU, not by the link."""
    cpu = r.get("cpu_s_per_step")
    return "-" if cpu is None else f"{cpu:.2f} ({cpu / r['step_s']:.2f})"


def _link_bytes(arm: str, r: dict[str, Any], out_dir: Path) -> float | None:
    """Bytes node 0 sends across the inter-node link per step (each way alike); None where not known."""
    from memrt.comm.select import tier_bytes

    if arm.startswith("memrt"):
        files = sorted((out_dir / f"memrt-report-{arm}").glob("rank*.json"))
        sent = 0
        for f in files:
            data = json.loads(f.read_text())
            if int(data["rank"]) in NODES[0]:
                sent += sum(int((c.get("tier_bytes") or {}).get("inter", 0)) for c in data.get("comm", []))
        return sent / r["steps"] if files and sent else None
    grad = {"stock": 4, "comm-only": 4, "torch-fp16": 2}.get(arm)  # bytes per gradient value on the wire
    if grad is None:
        return None
    return float(sum(tier_bytes("flat", grad * r["params"], NODES, rank)["inter"] for rank in NODES[0]))


def _summarize(results: dict[str, Any], out_dir: Path, link_bps: float | None) -> dict[str, Any]:
    stock, bound = results.get("stock"), results.get("compute-only")
    for arm, r in results.items():
        if stock:
            r["vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
            if r["final_loss"] is not None and stock["final_loss"]:
                r["loss_vs_stock"] = r["final_loss"] / stock["final_loss"] - 1
        if bound:
            r["of_bound"] = r["tokens_per_s"] / bound["tokens_per_s"]
        link = _link_bytes(arm, r, out_dir) if link_bps else None
        if link is not None:
            r["link_bytes_per_step"] = link
            compute_s = bound["step_s"] if bound and arm != "comm-only" else 0.0
            r["serial_bound_s"] = compute_s + link * 8 / link_bps
            r["of_serial_bound"] = r["serial_bound_s"] / r["step_s"]
    out: dict[str, Any] = {}
    if stock and bound and "comm-only" in results:
        comm = results["comm-only"]["step_s"]
        out["split"] = {"compute_s": bound["step_s"], "comm_s": comm, "stock_s": stock["step_s"],
                        "comm_share_of_stock": max(0.0, 1 - bound["step_s"] / stock["step_s"]),
                        "stock_of_bound": bound["step_s"] / stock["step_s"],
                        "compute_cores_busy": bound["cpu_s_per_step"] / bound["step_s"]
                        if bound.get("cpu_s_per_step") else None}
    return out


def _goals(results: dict[str, Any]) -> list[dict[str, str]]:
    """Each target: met / NOT met with the value and, when missed, by how much; 'not measured' without its arms."""
    def ratio(arm: str, base: str) -> float | None:
        a, b = results.get(arm), results.get(base)
        return a["tokens_per_s"] / b["tokens_per_s"] if a and b else None

    def bound_ratio(arm: str, base: str) -> float | None:
        """The ratio ``arm`` would reach at its serial link bound against ``base`` as measured."""
        a, b = results.get(arm), results.get(base)
        return b["step_s"] / a["serial_bound_s"] if a and b and a.get("serial_bound_s") else None

    def at_least(name: str, value: float | None, target: float, bound: float | None) -> dict[str, str]:
        if value is None:
            return {"goal": name, "status": "not measured", "value": "-"}
        at_bound = "" if bound is None else f"; the serial link bound allows {fmt_ratio(bound)}"
        if value >= target:
            return {"goal": name, "status": "met", "value": fmt_ratio(value) + at_bound}
        return {"goal": name, "status": "NOT met",
                "value": f"{fmt_ratio(value)}, short by {target - value:.2f}x ({100 * (value / target - 1):+.0f}%)"
                         + at_bound}

    out = [at_least("memrt exact >= 1.3x stock tokens/s", ratio("memrt", "stock"), 1.3, bound_ratio("memrt", "stock"))]
    for codec in ("bf16", "fp16"):
        arm = f"memrt-{codec}"
        out.append(at_least(f"memrt {codec} >= 1.2x torch fp16_compress_hook", ratio(arm, "torch-fp16"), 1.2,
                            bound_ratio(arm, "torch-fp16")))
    out.append(at_least("int8 >= 2x stock tokens/s", ratio("memrt-int8", "stock"), 2.0, bound_ratio("memrt-int8", "stock")))
    int8, stock = results.get("memrt-int8"), results.get("stock")
    loss = int8.get("loss_vs_stock") if int8 else None
    if loss is None:
        out.append({"goal": "int8 loss within 1% of stock", "status": "not measured", "value": "-"})
    else:
        out.append({"goal": "int8 loss within 1% of stock", "status": "met" if abs(loss) <= 0.01 else "NOT met",
                    "value": f"{100 * loss:+.2f}%" + ("" if abs(loss) <= 0.01 else f", {100 * (abs(loss) - 0.01):.2f} points over")})
    for r in ("r1", "r4"):
        ps = results.get(f"torch-powersgd-{r}")
        name = f"int8 ahead of PowerSGD {r} at equal or better loss"
        if not (int8 and ps and stock):
            out.append({"goal": name, "status": "not measured", "value": "-"})
            continue
        speed = int8["tokens_per_s"] / ps["tokens_per_s"]
        better_loss = int8["final_loss"] is not None and (ps["final_loss"] is None or int8["final_loss"] <= ps["final_loss"] * 1.001)
        met = speed > 1.0 and better_loss
        value = (f"{fmt_ratio(speed)} its tokens/s, loss {int8['final_loss']:.4f} vs {ps['final_loss']:.4f}"
                 if ps["final_loss"] is not None else f"{fmt_ratio(speed)} its tokens/s")
        if not met:
            value += ", short: " + ", ".join(x for x in (f"speed {100 * (speed - 1):+.0f}%" if speed <= 1 else "",
                                                          "loss higher" if not better_loss else "") if x)
        out.append({"goal": name, "status": "met" if met else "NOT met", "value": value})
    return out


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
