"""Reading a run's ``rank*.json`` for ``memrt report``: every file checked before any figure is computed from it.

A file is used only when it is whole JSON, of a schema this memrt reads, and every field the report reads
has its type (a rank number, memory events with a time, live bytes and a kind, comm records with op, bytes
and seconds, trace events with a start and a duration, plans whose byte figures are numbers). Anything else
is a :class:`RankFileProblem` naming the file and the first bad field; the report goes on with the others.

One report is one run: files carry the run id that the ranks agreed on at start (``meta.run_id``). When a
folder holds files of several runs (a reused ``MEMRT_REPORT_DIR``), the run of the newest file is reported
(or the one asked for) and every other file is named and skipped.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memrt.errors import MemrtError
from memrt.profiling.recorder import SCHEMA_VERSION

__all__ = ["RankFileProblem", "load_rank_files", "check_rank_file", "run_id_of"]

logger = logging.getLogger("memrt.profiling.report")
_RANK_FILE = re.compile(r"^rank(\d+)\.json$", re.ASCII)
_REQUIRED = ("rank", "memory", "comm", "trace")


@dataclass(kw_only=True, slots=True)
class RankFileProblem:
    """A rank file that could not be used, and why."""

    path: str
    reason: str
    note: str = "left out, the other ranks are reported"
    """What the report did about it."""

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}; {self.note}"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _text(x: Any) -> bool:
    return isinstance(x, str)


def _optional(check):
    return lambda x: x is None or check(x)


def _tier_bytes(x: Any) -> bool:
    return isinstance(x, dict) and all(_text(k) and _number(v) for k, v in x.items())


# field -> (check, required); what report.py, comm_log.py, timeline.py and trace.py read
_MEMORY = {"t": (_number, True), "live_bytes": (_number, True), "kind": (_text, True),
           "label": (_optional(_text), False)}
_COMM = {"op": (_text, True), "nbytes": (_count, True), "seconds": (_number, True), "dtype": (_text, False),
         "algorithm": (_text, False), "group_size": (_count, False), "tier_bytes": (_optional(_tier_bytes), False),
         "predicted_seconds": (_optional(_number), False), "start": (_optional(_number), False),
         "redop": (_optional(_text), False)}
_TRACE = {"name": (_text, True), "ts_us": (_number, True), "dur_us": (_number, True), "tid": (_count, False),
          "cat": (_text, False), "args": (lambda x: isinstance(x, dict), False)}
_UNIT = {"name": (_optional(_text), False), "action": (_optional(_text), False),
         "bytes_kept": (_optional(_number), False), "bytes_freed": (_optional(_number), False),
         "bytes_moved": (_optional(_number), False), "added_seconds": (_optional(_number), False)}
_PLAN_FIGURES = ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes")


def _bad_record(records: Any, spec: dict[str, tuple[Any, bool]], what: str) -> str | None:
    if not isinstance(records, list):
        return f"'{what}' is {type(records).__name__}, not a list"
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            return f"{what} entry {i} is {type(rec).__name__}, not an object"
        for name, (check, required) in spec.items():
            if name not in rec:
                if required:
                    return f"{what} entry {i} has no '{name}'"
                continue
            if not check(rec[name]):
                return f"{what} entry {i} has a bad '{name}': {rec[name]!r}"
    return None


def _bad_plan(plan: Any, i: int) -> str | None:
    if isinstance(plan, str):
        try:
            plan = json.loads(plan)
        except json.JSONDecodeError:
            return f"plan {i} is not JSON"
    if not isinstance(plan, dict):
        return f"plan {i} is {type(plan).__name__}, not an object"
    for k in _PLAN_FIGURES:
        if plan.get(k) is not None and not _number(plan[k]):
            return f"plan {i} has a bad '{k}': {plan[k]!r}"
    bad = _bad_record(plan.get("units", []), _UNIT, f"plan {i} unit")
    return bad


def _plans_of(data: dict[str, Any]) -> list[Any]:
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    activation = meta.get("activation")
    extra = activation.get("plans", []) if isinstance(activation, dict) else []
    plans = data.get("plans", [])
    return (plans if isinstance(plans, list) else [plans]) + (extra if isinstance(extra, list) else [extra])


def check_rank_file(data: Any) -> str | None:
    """Why ``data`` (one parsed rank file) cannot be reported, or None when every field the report reads is sound."""
    if not isinstance(data, dict):
        return f"not a memrt rank file (a JSON {type(data).__name__}, not an object)"
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        return f"not a memrt rank file (missing {', '.join(missing)})"
    schema = data.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        return f"schema {schema!r} is not one memrt writes (an integer; this memrt reads up to {SCHEMA_VERSION})"
    if schema > SCHEMA_VERSION:
        return f"schema {schema} is newer than this memrt reads ({SCHEMA_VERSION}): upgrade memrt"
    if not _count(data["rank"]):
        return f"'rank' is {data['rank']!r}, not a rank number"
    if "meta" in data and not isinstance(data["meta"], dict):
        return f"'meta' is {type(data['meta']).__name__}, not an object"
    fixed = (data.get("meta") or {}).get("fixed_bytes")
    if fixed is not None and not _number(fixed):
        return f"'meta.fixed_bytes' is {fixed!r}, not a number of bytes"
    for key in ("t0_unix", "t0_perf"):
        if data.get(key) is not None and not _number(data[key]):
            return f"'{key}' is {data[key]!r}, not a number"
    for what, spec in (("memory", _MEMORY), ("comm", _COMM), ("trace", _TRACE)):
        bad = _bad_record(data[what], spec, what)
        if bad:
            return bad
    for i, plan in enumerate(_plans_of(data)):
        bad = _bad_plan(plan, i)
        if bad:
            return bad
    return None


def run_id_of(data: dict[str, Any]) -> str | None:
    """The run id a rank file carries (set by the activation layer or memrt.profiling users), or None."""
    meta = data.get("meta") or {}
    run = meta.get("run_id")
    if run is None and isinstance(meta.get("activation"), dict):
        run = meta["activation"].get("run_id")
    return None if run is None else str(run)


def _read(path: Path, number: int) -> tuple[dict[str, Any] | None, str | None]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # memrt writes one JSON object: a file that does not end with '}' was cut short
        what = "truncated" if not text.rstrip().endswith("}") else "corrupt"
        return None, (f"{what} JSON ({exc.msg} at byte {exc.pos} of {len(text)}); "
                      "was the run killed while writing?")
    except RecursionError:
        return None, "corrupt JSON (nested too deeply)"
    bad = check_rank_file(data)
    if bad:
        return None, bad
    if data["rank"] != number:
        logger.warning("%s says rank %s; using the file name's rank %d", path, data["rank"], number)
        data["rank"] = number
    return data, None


def load_rank_files(directory: str | Path, *, run_id: str | None = None
                    ) -> tuple[list[dict[str, Any]], list[RankFileProblem]]:
    """The rank files of one run sorted by rank, and every file left out (malformed, or of another run).

    ``run_id`` picks the run; by default it is the run of the most recently written usable file.
    """
    d = Path(directory)
    if not d.is_dir():
        raise MemrtError(f"report directory {str(d)!r} does not exist: pass the MEMRT_REPORT_DIR of the run "
                         "(default ./memrt-report/<run id>/)")
    files = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _RANK_FILE.match(p.name)))
    loaded: list[tuple[dict[str, Any], Path, float]] = []
    problems: list[RankFileProblem] = []
    for number, path in files:
        data, why = _read(path, number)
        if why is not None:
            problems.append(RankFileProblem(path=str(path), reason=why))
            continue
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = 0.0
        loaded.append((data, path, mtime))
    runs = {run_id_of(data) for data, _, _ in loaded}
    if run_id is not None and run_id not in runs:
        raise MemrtError(f"no rank file of run {run_id!r} in {str(d)!r}; runs there: "
                         f"{', '.join(sorted(str(r) for r in runs)) or 'none'}")
    if run_id is None and len(runs) > 1:  # the newest file's run (ties: the run with more files)
        count = {r: sum(run_id_of(x) == r for x, _, _ in loaded) for r in runs}
        run_id = run_id_of(max(loaded, key=lambda x: (x[2], count[run_id_of(x[0])]))[0])
    ranks = []
    for data, path, _ in loaded:
        other = run_id_of(data)
        if len(runs) > 1 and other != run_id:
            problems.append(RankFileProblem(path=str(path), reason=f"of run {other or '(no run id)'}, not of the "
                                            f"reported run {run_id or '(no run id)'} (a reused report folder?)",
                                            note="skipped"))
            continue
        ranks.append(data)
    problems += _missing_ranks(d, ranks, problems)
    return ranks, problems


def _missing_ranks(d: Path, ranks: list[dict[str, Any]], problems: list[RankFileProblem]) -> list[RankFileProblem]:
    sizes = {size for r in ranks if _count(size := (r.get("meta") or {}).get("world_size"))}
    if len(sizes) != 1:
        return []
    world = sizes.pop()
    named = {int(m.group(1)) for p in problems if (m := _RANK_FILE.match(Path(p.path).name))}
    missing = sorted(set(range(world)) - {r["rank"] for r in ranks} - named)
    if not missing:
        return []
    return [RankFileProblem(path=str(d), reason=f"no file for rank(s) {', '.join(map(str, missing))} of the run's "
                                                f"{world}", note="the report covers the ranks that wrote one")]
