"""``memrt report DIR``: merge a run's ``rank*.json`` into a text report, a JSON twin, traces and plots.

Writes into DIR (or ``--out``): ``report.txt``, ``report.json``, ``trace.json`` (all ranks, one
process per rank) and ``trace_rank{r}.json``, and with matplotlib ``memory_timeline.png``,
``plan.png`` and ``comm_time.png``. A truncated or corrupt rank file is named in a message and left
out; the other ranks are still reported (exit status 1 then, 0 when every file loaded).
No torch at import or run time.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memrt.errors import MemrtError
from memrt.profiling import comm_log, plots, timeline
from memrt.profiling.recorder import SCHEMA_VERSION
from memrt.profiling.trace import write_chrome_trace

__all__ = ["RankFileProblem", "add_arguments", "build_report", "format_text", "load_rank_files", "run",
           "write_report"]

logger = logging.getLogger(__name__)
_RANK_FILE = re.compile(r"^rank(\d+)\.json$")
_REQUIRED = ("rank", "memory", "comm", "trace")


@dataclass(kw_only=True, slots=True)
class RankFileProblem:
    """A rank file that could not be used, and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}; left out, the other ranks are reported"


def load_rank_files(directory: str | Path) -> tuple[list[dict[str, Any]], list[RankFileProblem]]:
    """Loaded rank files sorted by rank, and the files that were truncated, corrupt or not memrt's."""
    d = Path(directory)
    if not d.is_dir():
        raise MemrtError(f"report directory {str(d)!r} does not exist: pass the MEMRT_REPORT_DIR of the run "
                         "(default ./memrt-report/<run id>/)")
    files = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _RANK_FILE.match(p.name)))
    ranks, problems = [], []
    for number, path in files:
        try:
            text = path.read_text()
        except OSError as exc:
            problems.append(RankFileProblem(path=str(path), reason=f"unreadable ({exc.strerror})"))
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            # memrt writes one JSON object: a file that does not end with '}' was cut short
            what = "truncated" if not text.rstrip().endswith("}") else "corrupt"
            problems.append(RankFileProblem(path=str(path), reason=f"{what} JSON ({exc.msg} at byte {exc.pos} "
                                            f"of {len(text)}); was the run killed while writing?"))
            continue
        missing = [k for k in _REQUIRED if not isinstance(data, dict) or k not in data]
        if missing:
            problems.append(RankFileProblem(path=str(path), reason=f"not a memrt rank file (missing {', '.join(missing)})"))
            continue
        if data.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            problems.append(RankFileProblem(path=str(path), reason=f"schema {data['schema']} is newer than this "
                                            f"memrt reads ({SCHEMA_VERSION}): upgrade memrt"))
            continue
        if int(data["rank"]) != number:
            logger.warning("%s says rank %s; using the file name's rank %d", path, data["rank"], number)
            data["rank"] = number
        ranks.append(data)
    return ranks, problems


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
    return plans


def _budget(ranks: list[dict[str, Any]]) -> int | None:
    for data in ranks:
        for plan in reversed(_rank_plans(data)):
            p = _plan_dict(plan)
            if p and p.get("budget_bytes"):
                return int(p["budget_bytes"])
        if data.get("meta", {}).get("budget_bytes"):
            return int(data["meta"]["budget_bytes"])
    return None


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
    return {
        "schema": SCHEMA_VERSION,
        "directory": directory,
        "ranks": [int(d["rank"]) for d in ranks],
        "problems": [asdict(p) for p in problems],
        "meta": {int(d["rank"]): d.get("meta", {}) for d in ranks},
        "budget_bytes": _budget(ranks),
        "memory": {r: tl.to_dict(max_points=max_points) for r, tl in memory.items()},
        "plans": plans,
        "comm": {"rows": [asdict(r) for r in rows], "per_rank": per_rank_rows,
                 "spreads": [asdict(s) for s in spreads], "stragglers": [asdict(s) for s in stragglers]},
        "files": {},
    }


def _plan_table(plan: dict[str, Any]) -> str:
    from memrt.config import format_bytes as fb

    out = [f"{'unit':<24} {'action':<22} {'kept':>11} {'freed':>11} {'moved':>11} {'added(ms)':>9}"]
    for u in plan.get("units", []):
        out.append(f"{str(u.get('name', '?')):<24} {str(u.get('action', '?')):<22} {fb(u.get('bytes_kept', 0)):>11} "
                   f"{fb(u.get('bytes_freed', 0)):>11} {fb(u.get('bytes_moved', 0)):>11} "
                   f"{1e3 * float(u.get('added_seconds', 0.0)):>9.2f}")
    tail = [f"{k}={fb(plan[k])}" for k in ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes") if plan.get(k)]
    if tail:
        out.append("  ".join(tail))
    return "\n".join(out)


def format_text(report: dict[str, Any]) -> str:
    """The human-readable report (tables) from :func:`build_report`'s dict."""
    out = [f"memrt report: {report['directory'] or '.'}",
           f"ranks: {', '.join(map(str, report['ranks'])) or 'none'}"]
    for p in report["problems"]:
        out.append(f"WARNING: {RankFileProblem(**p)}")
    out += ["", "== memory (peak, fixed = live at step start, activation = peak - fixed) =="]
    tls = {int(r): timeline.MemoryTimeline(points=[], steps=[timeline.StepMemory(**s) for s in d["steps"]],
                                           peak=timeline.PeakAttribution(**d["peak"]) if d["peak"] else None)
           for r, d in report["memory"].items()}
    out.append(timeline.format_memory_table(tls, budget_bytes=report["budget_bytes"]))
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


def write_report(directory: str | Path, out_dir: str | Path | None = None, *, plots_wanted: bool = True,
                 traces: bool = True) -> tuple[dict[str, Any], str]:
    """Load, build and write everything; returns (JSON twin, text). Raises MemrtError with no usable file."""
    directory = Path(directory)
    out = Path(out_dir) if out_dir else directory
    ranks, problems = load_rank_files(directory)
    if not ranks:
        why = "; ".join(map(str, problems)) if problems else "no rank*.json files in it"
        raise MemrtError(f"nothing to report in {str(directory)!r}: {why}")
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(ranks, problems, directory=str(directory))
    files = report["files"]
    if traces:
        files["trace"] = str(write_chrome_trace(out / "trace.json", ranks))
        for data in ranks:
            files[f"trace_rank{data['rank']}"] = str(write_chrome_trace(out / f"trace_rank{data['rank']}.json", data))
    if plots_wanted and plots.have_matplotlib():
        files["memory_plot"] = str(plots.plot_memory(report["memory"], out / "memory_timeline.png",
                                                     budget_bytes=report["budget_bytes"]))
        if report["plans"]:
            files["plan_plot"] = str(plots.plot_plan(next(iter(report["plans"].values())), out / "plan.png"))
        if report["comm"]["rows"]:
            files["comm_plot"] = str(plots.plot_comm(report["comm"]["rows"], out / "comm_time.png"))
    elif plots_wanted:
        report["plots_missing"] = plots.PLOT_INSTALL_HINT
    files["json"] = str(out / "report.json")
    files["text"] = str(out / "report.txt")
    text = format_text(report)
    if report.get("plots_missing"):
        text += f"\nno plots: {report['plots_missing']}\n"
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.txt").write_text(text)
    return report, text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="report directory of a run (holds rank0.json, rank1.json, ...)")
    parser.add_argument("--out", default=None, help="where to write report.txt/json, traces and PNGs (default: DIRECTORY)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-traces", action="store_true", help="skip the Chrome trace files")


def run(args: argparse.Namespace) -> int:
    report, text = write_report(args.directory, args.out, plots_wanted=not args.no_plots,
                                traces=not args.no_traces)
    print(text, end="")
    for problem in report["problems"]:
        print(f"memrt report: {problem['path']}: {problem['reason']}; left out, the other ranks are reported",
              file=sys.stderr)
    return 1 if report["problems"] else 0
