"""``memrt report DIR``: merge a run's ``rank*.json`` into a text report, a JSON twin, traces and plots.

Writes into DIR (or ``--out``): ``report.txt``, ``report.json``, ``trace.json`` (all ranks, one
process per rank) and ``trace_rank{r}.json``, and with matplotlib ``memory_timeline.png``,
``plan.png`` and ``comm_time.png``; with ``--html`` one self-contained ``report.html``
(:mod:`memrt.profiling.html_report`). One report is one run (:mod:`memrt.profiling.rankfiles`): a
truncated, corrupt or malformed rank file, or a file of another run in a reused folder, is named in one
line and left out; the other ranks are still reported (exit status 1 then, 0 when every rank's file of the
run loaded). Each rank's peak is compared with its own budget. No torch at import or run time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memrt.errors import MemrtError
from memrt.profiling import comm_log, plots, timeline
from memrt.profiling.rankfiles import RankFileProblem, load_rank_files, run_id_of
from memrt.profiling.recorder import SCHEMA_VERSION, make_private_dir
from memrt.profiling.trace import write_chrome_trace

__all__ = ["RankFileProblem", "add_arguments", "build_report", "format_text", "load_rank_files", "run",
           "write_report"]

logger = logging.getLogger(__name__)


def _plan_dict(plan: Any) -> dict[str, Any] | None:
    if isinstance(plan, str):
        try:
            plan = json.loads(plan)
        except json.JSONDecodeError:
            return None
    return plan if isinstance(plan, dict) else None


def _rank_plans(data: dict[str, Any]) -> list[Any]:
    """Plans of a rank: ``add_plan`` ones, else those the activation layer put in meta['activation']."""
    plans = data.get("plans") or []
    if not plans:
        activation = data.get("meta", {}).get("activation")
        plans = activation.get("plans") or [] if isinstance(activation, dict) else []
    return plans if isinstance(plans, list) else [plans]


def _budgets(ranks: list[dict[str, Any]]) -> dict[int, int | None]:
    """Each rank's own budget in bytes: its last plan's, else its meta's (MEMRT=1 records MEMRT_BUDGET resolved
    on the rank's device); None when it had none.

    Budgets are per rank (a share resolves against each rank's own device), so each rank's peak is
    compared with its own."""
    out: dict[int, int | None] = {}
    for data in ranks:
        budget = None
        for plan in reversed(_rank_plans(data)):
            p = _plan_dict(plan)
            if p and p.get("budget_bytes"):
                budget = int(p["budget_bytes"])
                break
        meta = data.get("meta") or {}
        activation = meta.get("activation") if isinstance(meta.get("activation"), dict) else {}
        for fallback in (meta.get("budget_bytes"), activation.get("budget_bytes")):
            if budget is None and _is_bytes(fallback):
                budget = int(fallback)
        out[int(data["rank"])] = budget
    return out


def _is_bytes(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _devices(ranks: list[dict[str, Any]]) -> dict[int, str]:
    """Each rank's device kind and name: what the activation layer recorded, else its last plan's device."""
    out: dict[int, str] = {}
    for data in ranks:
        activation = (data.get("meta") or {}).get("activation")
        device = activation.get("device") if isinstance(activation, dict) else None
        if isinstance(device, dict) and device.get("name"):
            out[int(data["rank"])] = str(device["name"])
            continue
        plan = next((p for p in map(_plan_dict, reversed(_rank_plans(data))) if p and p.get("device")), None)
        out[int(data["rank"])] = str(plan["device"]) if plan else "?"
    return out


def build_report(ranks: list[dict[str, Any]], problems: list[RankFileProblem], *,
                 directory: str = "", max_points: int = 5000) -> dict[str, Any]:
    """The JSON twin: every figure the text report prints, structured."""
    memory = {}
    for data in ranks:
        fixed = data.get("meta", {}).get("fixed_bytes")
        memory[int(data["rank"])] = timeline.analyze_memory(data["memory"], fixed_bytes=fixed)
    plans = {}
    for data in ranks:
        last = next((p for p in map(_plan_dict, reversed(_rank_plans(data))) if p), None)
        if last is not None:
            plans[int(data["rank"])] = last
    rows = comm_log.summarize_comm({int(d["rank"]): d["comm"] for d in ranks})
    per_rank_rows = {int(d["rank"]): [asdict(r) for r in comm_log.summarize_comm(d["comm"])] for d in ranks}
    spreads, stragglers = comm_log.straggler_view(ranks)
    budgets = _budgets(ranks)
    shared = set(budgets.values())
    run_ids = sorted({str(run_id_of(d)) for d in ranks if run_id_of(d) is not None})
    return {
        "schema": SCHEMA_VERSION,
        "directory": directory,
        "run_id": run_ids[0] if len(run_ids) == 1 else None,
        "ranks": [int(d["rank"]) for d in ranks],
        "problems": [asdict(p) for p in problems],
        "meta": {int(d["rank"]): d.get("meta", {}) for d in ranks},
        "budget_bytes": shared.pop() if len(shared) == 1 else None,
        "budgets": budgets,
        "devices": _devices(ranks),
        "memory": {r: tl.to_dict(max_points=max_points) for r, tl in memory.items()},
        "plans": plans,
        "comm": {"rows": [asdict(r) for r in rows], "per_rank": per_rank_rows,
                 "spreads": [asdict(s) for s in spreads], "stragglers": [asdict(s) for s in stragglers]},
        "files": {},
    }


def _plan_table(plan: dict[str, Any]) -> str:
    from memrt.sizes import format_bytes as fb

    out = [f"{'unit':<24} {'action':<22} {'kept':>11} {'freed':>11} {'moved':>11} {'added(ms)':>9}"]
    def size(u: dict[str, Any], k: str) -> str:
        return "-" if u.get(k) is None else fb(u[k])

    for u in plan.get("units") or []:
        added = "-" if u.get("added_seconds") is None else f"{1e3 * float(u['added_seconds']):.2f}"
        out.append(f"{str(u.get('name', '?')):<24} {str(u.get('action', '?')):<22} {size(u, 'bytes_kept'):>11} "
                   f"{size(u, 'bytes_freed'):>11} {size(u, 'bytes_moved'):>11} {added:>9}")
    tail = [f"{k}={fb(plan[k])}" for k in ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes") if plan.get(k)]
    if tail:
        out.append("  ".join(tail))
    return "\n".join(out)


def format_text(report: dict[str, Any]) -> str:
    """The human-readable report (tables) from :func:`build_report`'s dict."""
    out = [f"memrt report: {report['directory'] or '.'}" + (f" | run {report['run_id']}" if report.get("run_id") else ""),
           f"ranks: {', '.join(map(str, report['ranks'])) or 'none'}"]
    for p in report["problems"]:
        out.append(f"WARNING: {RankFileProblem(**p)}")
    out += ["", "== memory (peak, fixed = live at step start, activation = peak - fixed) =="]
    tls = {int(r): timeline.MemoryTimeline(points=[], steps=[timeline.StepMemory(**s) for s in d["steps"]],
                                           peak=timeline.PeakAttribution(**d["peak"]) if d["peak"] else None)
           for r, d in report["memory"].items()}
    budgets = {int(r): b for r, b in report["budgets"].items()}
    out.append(timeline.format_memory_table(tls, budget_bytes=budgets,
                                            devices={int(r): d for r, d in report["devices"].items()}))
    if report["plans"]:
        distinct = {json.dumps(p, sort_keys=True): r for r, p in report["plans"].items()}
        for key, rank in distinct.items():
            same = [r for r, p in report["plans"].items() if json.dumps(p, sort_keys=True) == key]
            out += ["", f"== plan per unit (rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}) =="]
            out.append(_plan_table(report["plans"][rank]))
    rows = [comm_log.CommRow(**r) for r in report["comm"]["rows"]]
    out += ["", "== collectives (nccl-tests columns; time = mean per call, averaged over ranks; "
            "busbw per nccl-tests doc/PERFORMANCE.md) ==", comm_log.format_comm_table(rows)]
    if len(report["ranks"]) > 1:
        out += ["", "== stragglers (per-rank time spread and arrival order) =="]
        out.append(comm_log.format_straggler_table([comm_log.RankSpread(**s) for s in report["comm"]["spreads"]],
                                                   [comm_log.Straggler(**s) for s in report["comm"]["stragglers"]]))
    if report["files"]:
        out += ["", "== files =="] + [f"{k}: {v}" for k, v in report["files"].items()]
    return "\n".join(out) + "\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_TRUNC


def write_report(directory: str | Path, out_dir: str | Path | None = None, *, plots_wanted: bool = True,
                 traces: bool = True, run_id: str | None = None, html: bool = False,
                 html_path: str | Path | None = None) -> tuple[dict[str, Any], str]:
    """Load, build and write everything; returns (JSON twin, text). Raises MemrtError with no usable file.

    ``html`` (or a ``html_path``) also writes the self-contained page, by default ``report.html`` in the output.

    Folders it creates are 0700 and every file it writes 0600, like the rank files."""
    directory = Path(directory)
    out = Path(out_dir) if out_dir else directory
    ranks, problems = load_rank_files(directory, run_id=run_id)
    if not ranks:
        why = "; ".join(map(str, problems)) if problems else "no rank*.json files in it"
        raise MemrtError(f"nothing to report in {str(directory)!r}: {why}")
    try:
        make_private_dir(out)
    except OSError as exc:
        raise MemrtError(f"cannot write the report into {str(out)!r} ({exc}): pass --out with a folder you can "
                         "write") from None
    report = build_report(ranks, problems, directory=str(directory))
    files = report["files"]
    if traces:
        files["trace"] = str(write_chrome_trace(out / "trace.json", ranks))
        for data in ranks:
            files[f"trace_rank{data['rank']}"] = str(write_chrome_trace(out / f"trace_rank{data['rank']}.json", data))
    if plots_wanted and plots.have_matplotlib():
        budgets = {r: b for r, b in report["budgets"].items() if b}
        files["memory_plot"] = str(plots.plot_memory(report["memory"], out / "memory_timeline.png",
                                                     budget_bytes=budgets or None))
        if report["plans"]:
            files["plan_plot"] = str(plots.plot_plan(next(iter(report["plans"].values())), out / "plan.png"))
        if report["comm"]["rows"]:
            files["comm_plot"] = str(plots.plot_comm(report["comm"]["rows"], out / "comm_time.png"))
    elif plots_wanted:
        report["plots_missing"] = plots.PLOT_INSTALL_HINT
    files["json"] = str(out / "report.json")
    files["text"] = str(out / "report.txt")
    if html or html_path:
        files["html"] = str(Path(html_path) if html_path else out / "report.html")
    text = format_text(report)
    if report.get("plots_missing"):
        text += f"\nno plots: {report['plots_missing']}\n"
    if "html" in files:
        from memrt.profiling.html_report import render_html

        page = render_html(report, ranks, text=text)
        try:
            make_private_dir(Path(files["html"]).parent)
            _write_private(Path(files["html"]), page)
        except OSError as exc:
            raise MemrtError(f"cannot write the HTML page {files['html']!r} ({exc}): pass --output with a file in a "
                             "folder you can write") from None
    for name, path in files.items():
        if name not in ("json", "text", "html") and Path(path).exists():
            os.chmod(path, 0o600)
    _write_private(out / "report.json", json.dumps(report, indent=1))
    _write_private(out / "report.txt", text)
    return report, text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="report directory of a run (holds rank0.json, rank1.json, ...)")
    parser.add_argument("--out", default=None, help="where to write report.txt/json, traces and PNGs (default: DIRECTORY)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-traces", action="store_true", help="skip the Chrome trace files")
    parser.add_argument("--run", default=None, help="the run id to report when the folder holds files of several "
                                                    "runs (default: the run of the newest file)")
    parser.add_argument("--html", action="store_true", help="also write one self-contained HTML page (report.html; "
                                                            "plots inline, nothing fetched from the network)")
    parser.add_argument("--output", default=None, metavar="FILE", help="where to write the HTML page (implies --html; "
                                                                       "default: report.html in the output folder)")


def run(args: argparse.Namespace) -> int:
    report, text = write_report(args.directory, args.out, plots_wanted=not args.no_plots,
                                traces=not args.no_traces, run_id=args.run, html=args.html, html_path=args.output)
    print(text, end="")
    for problem in report["problems"]:
        print(f"memrt report: {RankFileProblem(**problem)}", file=sys.stderr)
    return 1 if report["problems"] else 0
