"""``memrt report DIR --html``: the report as one self-contained HTML page.

One file, no network: no scripts, fonts or images by URL; plots are matplotlib PNGs (:mod:`memrt.profiling.plots`)
inlined as base64 ``data:`` URIs, and every key figure is also text. Sections: key numbers, memory per rank,
step time per rank (:mod:`memrt.profiling.steps`), communication per tier and algorithm
(:func:`memrt.profiling.comm_log.call_stats`, the text report's rows and straggler view), balance shares over
time, the plan per unit, and the text report itself. Built from :func:`memrt.profiling.report.build_report`'s
dict and the loaded rank files; no torch. Without matplotlib the page has the tables and says how to get plots.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from memrt.profiling import comm_log, plots
from memrt.profiling.steps import StepSplit, step_split
from memrt.sizes import format_bytes

__all__ = ["render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d1d1f;background:#fff;max-width:1200px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}p.sub{color:#555;margin:0 0 12px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f6}td.l,th.l{text-align:left}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px}
.card .k{font-size:12px;color:#555}.card .v{font-size:18px;font-weight:600}
.note{color:#555;font-size:13px}.warn{color:#a40000}.over{color:#a40000;font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:4px 0}pre{font-size:12px;background:#f8f8f8;padding:8px;overflow-x:auto}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _bytes(x: Any) -> str:
    return "-" if x is None else format_bytes(int(x))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1, cls: str = "") -> str:
    """An HTML table; the first ``left`` columns are left-aligned text."""
    th = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(c)}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _img(draw: Callable[..., Path], data: Any, alt: str, **kw: Any) -> str:
    """One of :mod:`memrt.profiling.plots`' PNGs, drawn into a temporary file and inlined as base64."""
    if not plots.have_matplotlib():
        return f'<p class="note">{_e(plots.PLOT_INSTALL_HINT)}</p>'
    with tempfile.TemporaryDirectory(prefix="memrt-html-") as tmp:
        path = draw(data, Path(tmp) / "plot.png", **kw)
        encoded = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{encoded}">'


def _card(key: str, value: str, ident: str) -> str:
    return f'<div class="card" id="key-{ident}"><div class="k">{_e(key)}</div><div class="v">{_e(value)}</div></div>'


def _tier_totals(ranks: Sequence[Mapping[str, Any]]) -> tuple[dict[int, dict[str, int]], list[dict[str, Any]]]:
    """Bytes sent per tier per rank, and per (op, algorithm, ranks) the merged :class:`comm_log.CallStats`."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    per_rank: dict[int, dict[str, int]] = {}
    for data in ranks:
        mine: dict[tuple, list[dict]] = defaultdict(list)
        for r in data.get("comm") or []:
            key = (r["op"], r.get("algorithm", ""), int(r.get("group_size", 1)))
            mine[key].append(r)
            groups[key].append(r)
        tiers: dict[str, int] = defaultdict(int)
        for records in mine.values():
            for tier, n in comm_log.call_stats(records).tier_bytes_total.items():
                tiers[tier] += n
        per_rank[int(data["rank"])] = dict(tiers)
    merged = []
    for (op, algo, n), records in sorted(groups.items()):
        stats = comm_log.call_stats(records)
        merged.append({"op": op, "algorithm": algo, "group_size": n, "stats": stats})
    return per_rank, merged


def _key_numbers(report: dict[str, Any], splits: list[StepSplit], tiers: dict[int, dict[str, int]]) -> str:
    peaks = {int(r): (tl.get("peak") or {}).get("live_bytes") for r, tl in report["memory"].items()}
    budgets = {int(r): b for r, b in report["budgets"].items()}
    top = max((r for r in peaks if peaks[r] is not None), key=lambda r: peaks[r], default=None)
    cards = [_card("ranks", str(len(report["ranks"])), "ranks")]
    if top is not None:
        cards.append(_card(f"peak memory (rank {top})", _bytes(peaks[top]), "peak"))
        budget = budgets.get(top)
        cards.append(_card(f"budget (rank {top})", _bytes(budget) if budget else "none", "budget"))
        if budget:
            cards.append(_card("peak / budget", f"{peaks[top] / budget:.1%}", "budget-use"))
    timed = [s for s in splits if s.step_seconds is not None]
    if timed:
        slow = max(timed, key=lambda s: s.step_seconds)
        cards.append(_card(f"step time (rank {slow.rank}, {slow.source})", f"{_ms(slow.step_seconds)} ms", "step"))
    comm = [s.comm_total_seconds for s in splits]
    if any(comm):
        cards.append(_card("time in collectives (max rank)", f"{max(comm):.3f} s", "comm"))
    total: dict[str, int] = defaultdict(int)
    for t in tiers.values():
        for tier, n in t.items():
            total[tier] += n
    for tier, n in sorted(total.items()):
        cards.append(_card(f"bytes sent, tier {tier} (all ranks)", _bytes(n), f"tier-{tier}"))
    return f'<div class="cards">{"".join(cards)}</div>'


def _memory_section(report: dict[str, Any]) -> str:
    budgets = {int(r): b for r, b in report["budgets"].items()}
    devices = {int(r): d for r, d in report["devices"].items()}
    rows, images = [], []
    for rank, tl in sorted((int(r), tl) for r, tl in report["memory"].items()):
        p, budget = tl.get("peak"), budgets.get(rank)
        if p is None:
            rows.append([rank, len(tl["steps"]), "(no memory events)", "-", "-", _bytes(budget), "-",
                         devices.get(rank, "?"), "-"])
            continue
        rows.append([rank, len(tl["steps"]), _bytes(p["live_bytes"]), _bytes(p["fixed_bytes"]),
                     _bytes(p["activation_bytes"]), _bytes(budget) if budget else "-",
                     f"{p['live_bytes'] / budget:.1%}" if budget else "-", devices.get(rank, "?"),
                     f"step {p['step']}, {p['unit']}, {p['phase'] or '?'}"])
        images.append(f"<h3>rank {rank}</h3>" + _img(plots.plot_memory, {rank: tl}, f"memory timeline rank {rank}",
                                                     budget_bytes={rank: budget} if budget else None))
    head = ["rank", "steps", "peak", "fixed", "activation", "budget", "budget use", "device", "peak at"]
    return ('<h2 id="memory">Memory per rank</h2><p class="sub">Live bytes over time; fixed = live at step start '
            "(parameters, gradients, optimizer state), activation = peak - fixed; each rank against its own budget "
            "(red dashed line).</p>" + _table(head, rows, left=0) + "".join(images))


def _steps_section(splits: list[StepSplit]) -> str:
    rows = [[s.rank, s.source, s.steps, _ms(s.step_seconds), _ms(s.comm_seconds), _ms(s.other_seconds),
             f"{s.comm_total_seconds:.3f}", "-" if s.run_seconds is None else f"{s.run_seconds:.2f}",
             "-" if s.run_steps is None else s.run_steps, _ms(s.run_seconds_per_step),
             "-" if s.samples_per_s is None else f"{s.samples_per_s:.1f}"] for s in splits]
    head = ["rank", "step windows from", "windows", "step (ms)", "in collectives (ms)", "other (ms)",
            "collectives, whole run (s)", "run (s)", "run steps", "run s/step (ms)", "samples/s"]
    timed = [asdict(s) for s in splits if s.step_seconds is not None]
    image = _img(plots.plot_step_split, timed, "step time per rank") if timed else (
        '<p class="note">No step windows recorded (no memrt::step ranges, no step_begin/step_end memory '
        "events).</p>")
    return ('<h2 id="steps">Step time per rank</h2><p class="sub">Mean of the recorded step windows: time inside '
            "collectives that started in the window (on CPU backends including waits for the other ranks; on "
            "CUDA stream time, which may overlap compute) and the rest. Not recorded separately: compute, data "
            "loading and waits outside collectives (balance waits included) are all in <i>other</i>. With "
            "MEMRT=1 the windows are the planner's profile/certify steps (measuring hooks on: slower than "
            "ordinary steps); <i>run s/step</i> is the whole session over the steps the balance controller "
            "counted, set-up included; samples/s is the rank's own work in the last balance decision.</p>"
            + _table(head, rows, left=2) + image)


def _comm_section(report: dict[str, Any], tiers: dict[int, dict[str, int]], merged: list[dict[str, Any]]) -> str:
    names = sorted({t for per in tiers.values() for t in per})
    tier_rows = [[rank] + [_bytes(per.get(t, 0)) for t in names] for rank, per in sorted(tiers.items())]
    algo_rows = []
    for m in merged:
        s = m["stats"]
        algo_rows.append([m["op"], m["algorithm"], m["group_size"], s.calls, _bytes(s.bytes_total),
                          f"{s.mean_seconds * s.calls:.4f}", f"{s.mean_seconds * 1e6:.1f}", f"{s.algbw / 1e9:.3f}",
                          f"{s.busbw / 1e9:.3f}"] + [_bytes(s.tier_bytes_total.get(t, 0)) for t in names])
    rows = [[r["op"], r["algorithm"], r["group_size"], r["size_bytes"], r["count"], r["dtype"], r["redop"] or "-",
             f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", r["calls"],
             "-" if r["predicted_us"] is None else f"{r['predicted_us']:.1f}"] for r in report["comm"]["rows"]]
    out = ['<h2 id="comm">Communication per tier and algorithm</h2>']
    if not rows:
        return out[0] + '<p class="note">(no collectives recorded)</p>'
    out.append('<h3>bytes sent per tier, per rank</h3>' + (_table(["rank"] + names, tier_rows, left=0) if names else
                                                          '<p class="note">no per-tier bytes recorded</p>'))
    out.append("<h3>per op and algorithm (all ranks)</h3><p class=\"sub\">calls and bytes summed over the ranks; "
               "time per call and bandwidths from the mean call (nccl-tests doc/PERFORMANCE.md: algbw = size / "
               "time, busbw = algbw x the op's factor).</p>"
               + _table(["op", "algorithm", "ranks", "calls", "bytes", "seconds", "time/call (us)", "algbw (GB/s)",
                         "busbw (GB/s)"] + [f"tier {t}" for t in names], algo_rows, left=2))
    out.append("<h3>per size (the text report's nccl-tests table)</h3>" + _table(
        ["op", "algorithm", "ranks", "size (B)", "count", "type", "redop", "time (us)", "algbw (GB/s)",
         "busbw (GB/s)", "calls", "pred (us)"], rows, left=2))
    out.append(_img(plots.plot_comm, report["comm"]["rows"], "collective time per size"))
    stragglers = report["comm"]["stragglers"]
    if len(stragglers) > 1:
        out.append("<h3>stragglers</h3><pre>" + _e(comm_log.format_straggler_table(
            [comm_log.RankSpread(**s) for s in report["comm"]["spreads"]],
            [comm_log.Straggler(**s) for s in stragglers])) + "</pre>")
    return "".join(out)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _decisions(balance: Any) -> list[dict[str, Any]]:
    """The balance decisions whose figures have their types (rank files do not check this part of meta)."""
    if not isinstance(balance, dict) or not isinstance(balance.get("decisions"), list):
        return []
    out = []
    for d in balance["decisions"]:
        if not isinstance(d, dict) or not _num(d.get("step")):
            continue
        speeds, shares = d.get("samples_per_s"), d.get("shares")
        out.append({**d, "samples_per_s": [s if _num(s) else None for s in speeds] if isinstance(speeds, list) else [],
                    "shares": shares if isinstance(shares, list) and all(map(_num, shares)) else None,
                    "predicted_gain": d.get("predicted_gain") if _num(d.get("predicted_gain")) else 0.0})
    return out


def _balance_section(ranks: Sequence[Mapping[str, Any]]) -> str:
    head = '<h2 id="balance">Balance shares over time</h2>'
    balance, decisions = None, []
    for data in ranks:  # every rank records the same decisions: the first rank's that has any
        activation = (data.get("meta") or {}).get("activation")
        balance = activation.get("balance") if isinstance(activation, dict) else None
        decisions = _decisions(balance)
        if decisions:
            break
    if not decisions:
        return head + ('<p class="note">No balance decisions recorded (MEMRT=1 records them for DDP jobs fed by a '
                       "DistributedSampler; MEMRT_BALANCE=off or too few steps record none).</p>")
    rows = [[d["step"], "yes" if d.get("changed") else "no", d.get("shares") or "-",
             ", ".join("-" if s is None else f"{s:.1f}" for s in d.get("samples_per_s") or []),
             f"{100 * float(d['predicted_gain']):.1f}%", d.get("reason") or "-"] for d in decisions]
    return (head + f'<p class="sub">mode {_e(balance.get("mode"))}; {_e(balance.get("steps"))} steps; shares in '
            f'force at the end: {_e(balance.get("shares") or "stock split")}.</p>'
            + _img(plots.plot_shares, decisions, "balance shares over time")
            + _table(["step", "changed", "shares", "samples/s per rank", "predicted gain", "reason"], rows, left=0))


def _plan_section(report: dict[str, Any]) -> str:
    head = '<h2 id="plan">Plan per unit</h2>'
    if not report["plans"]:
        return head + '<p class="note">No memory plan recorded (MEMRT=1 with MEMRT_BUDGET plans the model).</p>'
    peaks = {int(r): (tl.get("peak") or {}).get("live_bytes") for r, tl in report["memory"].items()}
    distinct: dict[str, list[int]] = {}
    for rank, plan in report["plans"].items():
        distinct.setdefault(json.dumps(plan, sort_keys=True), []).append(int(rank))
    out = [head]
    for key, same in distinct.items():
        plan = json.loads(key)
        budget, measured = plan.get("budget_bytes"), plan.get("measured_peak_bytes")
        within = "-" if not (budget and measured) else ("yes" if measured <= budget else "NO")
        out.append(f"<h3>rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}</h3>")
        out.append(_table(["predicted peak", "measured peak (plan)", "timeline peak", "budget", "measured <= budget"],
                          [[_bytes(plan.get("predicted_peak_bytes")), _bytes(measured),
                            _bytes(max((peaks.get(r) or 0 for r in same), default=None)), _bytes(budget), within]],
                          left=0, cls="plan-summary"))
        units = [[u.get("name", "?"), u.get("action", "?"), _bytes(u.get("bytes_kept")), _bytes(u.get("bytes_freed")),
                  _bytes(u.get("bytes_moved")),
                  "-" if u.get("added_seconds") is None else f"{1e3 * float(u['added_seconds']):.2f}"]
                 for u in plan.get("units") or []]
        out.append(_table(["unit", "action", "bytes kept", "bytes freed", "bytes moved", "added (ms)"], units, left=2))
        out.append(_img(plots.plot_plan, plan, f"plan of rank {same[0]}"))
    return "".join(out)


def render_html(report: dict[str, Any], ranks: Sequence[Mapping[str, Any]], *, text: str = "") -> str:
    """The page for :func:`memrt.profiling.report.build_report`'s ``report`` of the loaded ``ranks``; ``text``
    (the text report) goes at the end, folded."""
    memory = {int(r): tl for r, tl in report["memory"].items()}
    splits = [step_split(data, memory.get(int(data["rank"]), {}).get("steps", [])) for data in ranks]
    tiers, merged = _tier_totals(ranks)
    title = f"memrt report{' | run ' + report['run_id'] if report.get('run_id') else ''}"
    problems = "".join(f'<li class="warn">{_e(p["path"])}: {_e(p["reason"])}; {_e(p["note"])}</li>'
                       for p in report["problems"])
    parts = [f"<h1>{_e(title)}</h1>",
             f'<p class="sub">{_e(report["directory"] or ".")} | ranks {_e(", ".join(map(str, report["ranks"])))}</p>',
             f"<ul>{problems}</ul>" if problems else "",
             '<h2 id="key">Key numbers</h2>', _key_numbers(report, splits, tiers),
             _memory_section(report), _steps_section(splits), _comm_section(report, tiers, merged),
             _balance_section(ranks), _plan_section(report)]
    if text:
        parts.append(f'<h2 id="text">Text report</h2><details><summary>report.txt</summary><pre>{_e(text)}</pre>'
                     "</details>")
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>" + "".join(parts) + "</body></html>\n")
