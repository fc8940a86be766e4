"""Render the results tables of README.md and docs/sections/*.md from the committed records.

    python -m benchmarks.render           # rewrite every marked region from benchmarks/records/*.json
    python -m benchmarks.render --check   # exit 1 (and name the pages) when a committed page differs

A record is one JSON file in ``benchmarks/records/``: ``id``, ``benchmark``, ``topic`` (the docs/sections page
that shows it), ``claim``, ``machine``, ``torch``, ``commit``, ``date``, ``figures`` (``detail``; ``summary`` for
the README), ``baseline``, ``target``, ``command``, ``source``, optionally ``headline`` (its place in the README's
headline table, 1-8), ``headline_claim``, ``headline_baseline`` and ``tables`` (``title``, ``headers``, ``rows``).
Records sharing an ``id`` are runs of one result: the latest ``date`` is shown. Pages show no dates, run
windows or commits: the records carry them.

A page marks each generated region with a pair of comments, the content between them being replaced:

    <!-- results:headline:begin --> ... <!-- results:headline:end -->    README: the headline table
    <!-- results:topic:begin --> ... <!-- results:topic:end -->          docs/sections/<topic>.md: its records
    <!-- results:tables:<id>:begin --> ... <!-- results:tables:<id>:end -->   the full tables of record <id>
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "RECORDS", "MAX_HEADLINE", "load_records", "pages", "render_page", "render_all", "main"]

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records"
MAX_HEADLINE = 8
"""At most this many results in the README's headline table."""

_REGION = re.compile(r"(<!-- results:(?P<name>[a-z0-9_:\-]+):begin -->\n)(?P<body>.*?)(<!-- results:(?P=name):end -->)",
                     re.DOTALL)
_FOOTER = ("<sub>Rendered by `python -m benchmarks.render` from `benchmarks/records/`; each record holds the machine, "
           "torch version, commit and date of its run.</sub>")


def load_records(folder: Path = RECORDS) -> dict[str, dict[str, Any]]:
    """The latest record of each ``id`` (by ``date``, then file name), keyed by id."""
    latest: dict[str, tuple[tuple[str, str], dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        for field in ("id", "topic", "claim", "figures", "baseline", "command", "machine", "torch"):
            if field not in rec:
                raise ValueError(f"{path}: record lacks the field {field!r}")
        key = (rec.get("date") or "", path.name)
        if rec["id"] not in latest or key > latest[rec["id"]][0]:
            latest[rec["id"]] = (key, rec)
    return {rid: rec for rid, (_, rec) in sorted(latest.items())}


def pages(root: Path = ROOT) -> list[Path]:
    """Every page that may hold generated regions."""
    return [root / "README.md", *sorted((root / "docs" / "sections").glob("*.md"))]


def _cell(text: Any) -> str:
    return str(text if text is not None else "-").replace("|", "\\|").replace("\n", " ")


def _command(rec: dict[str, Any]) -> str:
    return "`" + rec["command"].split("  #")[0].strip() + "`"


def _headline(records: dict[str, dict[str, Any]]) -> str:
    chosen = sorted((r for r in records.values() if r.get("headline")), key=lambda r: r["headline"])
    if not 0 < len(chosen) <= MAX_HEADLINE:
        raise ValueError(f"{len(chosen)} records carry 'headline': the README's table takes 1 to {MAX_HEADLINE}")
    lines = ["| result | figure | baseline | command |", "|---|---|---|---|"]
    for r in chosen:
        figure = r["figures"].get("summary") or r["figures"]["detail"]
        lines.append(f"| {_cell(r.get('headline_claim') or r['claim'])} | {_cell(figure)} "
                     f"| {_cell(r.get('headline_baseline') or r['baseline'])} "
                     f"| {_cell(_command(r))} |")
    return "\n".join(lines)


def _topic(records: dict[str, dict[str, Any]], topic: str) -> str:
    chosen = [r for r in records.values() if r["topic"] == topic]
    if not chosen:
        raise ValueError(f"no record has topic {topic!r} (docs/sections/{topic}.md has a results:topic region)")
    lines = ["| result | measured | baseline | target | machine | command |", "|---|---|---|---|---|---|"]
    for r in chosen:
        machine = f"{r['machine']}; torch {r['torch']}"
        lines.append(f"| {_cell(r['claim'])} | {_cell(r['figures']['detail'])} | {_cell(r['baseline'])} "
                     f"| {_cell(r.get('target'))} | {_cell(machine)} | {_cell(_command(r))} |")
    return "\n".join(lines)


def _tables(records: dict[str, dict[str, Any]], rid: str) -> str:
    if rid not in records or not records[rid].get("tables"):
        raise ValueError(f"no record {rid!r} with tables in {RECORDS}")
    r = records[rid]
    blocks = [f"Machine: {r['machine']}; torch {r['torch']}. Command: {_command(r)}."]
    for t in r["tables"]:
        rows = [f"| {' | '.join(_cell(h) for h in t['headers'])} |", "|" + "---|" * len(t["headers"])]
        rows += [f"| {' | '.join(_cell(c) for c in row)} |" for row in t["rows"]]
        blocks.append(f"**{t['title']}**\n\n" + "\n".join(rows))
    return "\n\n".join(blocks)


def _region(name: str, page: Path, records: dict[str, dict[str, Any]]) -> str:
    if name == "headline":
        body = _headline(records)
    elif name == "topic":
        body = _topic(records, page.stem)
    elif name.startswith("tables:"):
        body = _tables(records, name.split(":", 1)[1])
    else:
        raise ValueError(f"{page}: unknown region results:{name}")
    return f"{body}\n\n{_FOOTER}\n"


def render_page(text: str, page: Path, records: dict[str, dict[str, Any]]) -> str:
    """``text`` with each marked region replaced by its rendering."""
    return _REGION.sub(lambda m: m.group(1) + _region(m.group("name"), page, records) + m.group(4), text)


def render_all(root: Path = ROOT, records: dict[str, dict[str, Any]] | None = None) -> dict[Path, tuple[str, str]]:
    """Per page: (committed text, rendered text)."""
    records = load_records(root / "benchmarks" / "records") if records is None else records
    out = {}
    for page in pages(root):
        if page.exists():
            text = page.read_text()
            out[page] = (text, render_page(text, page, records))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page differs from its rendering")
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = p.parse_args(argv)
    stale = []
    for page, (old, new) in render_all(args.root).items():
        if old == new:
            continue
        stale.append(page)
        if not args.check:
            page.write_text(new)
            print(f"rendered {page.relative_to(args.root)}")
    if args.check and stale:
        print("results out of date (run: python -m benchmarks.render): "
              + ", ".join(str(p.relative_to(args.root)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
