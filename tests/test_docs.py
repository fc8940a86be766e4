"""The README and the topic pages stay short, undated and generated where they show results.

Fast, no processes. Each check is a function returning its problems for a repository root; the tests run
it on this checkout and, to show that it can fail, on a copy in ``tmp_path`` broken on purpose.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.render import render_all
from memrt.config import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 12 * 1024
README_MAX_LINE = 300

DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
UTC_TIME = re.compile(r"\b\d{1,2}:\d{2}(?:\s*-\s*\d{1,2}:\d{2})?\s*UTC\b|\b\d{2}:\d{2}-\d{2}:\d{2}\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def readme_size_problems(root: Path) -> list[str]:
    size = len((root / "README.md").read_bytes())
    return [f"README.md is {size} bytes (at most {README_MAX_BYTES})"] if size > README_MAX_BYTES else []


def readme_line_problems(root: Path) -> list[str]:
    lines = (root / "README.md").read_text().splitlines()
    return [f"README.md:{i}: {len(l)} characters (at most {README_MAX_LINE})"
            for i, l in enumerate(lines, 1) if len(l) > README_MAX_LINE]


def dated_prose_problems(root: Path) -> list[str]:
    """Dates, UTC times and commit hashes belong in benchmarks/records, not in the pages."""
    found = []
    for page in doc_pages(root):
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for what, pattern in (("date", DATE), ("UTC time", UTC_TIME), ("commit hash", COMMIT)):
                for m in pattern.finditer(line):
                    found.append(f"{page.relative_to(root)}:{i}: {what} {m.group(0)!r}")
    return found


def render_problems(root: Path) -> list[str]:
    rendered = render_all(root)
    found = [f"{p.relative_to(root)}: differs from `python -m benchmarks.render`" for p, (old, new) in rendered.items()
             if old != new]
    for page, region in ((root / "README.md", "headline"), (root / "docs/sections/benchmarks.md", "topic")):
        if f"<!-- results:{region}:begin -->" not in page.read_text():
            found.append(f"{page.relative_to(root)}: no results:{region} region")
    return found


def link_problems(root: Path) -> list[str]:
    found = []
    for target in LINK.findall((root / "README.md").read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (root / path).exists():
            found.append(f"README.md links to {target}, which does not exist")
    return found


def settings_problems(root: Path) -> list[str]:
    text = (root / "README.md").read_text()
    section = text.split("\n## Settings", 1)[1].split("\n## ", 1)[0] if "\n## Settings" in text else ""
    listed = set(re.findall(r"^\| `(MEMRT[A-Z_]*)` \|", section, re.MULTILINE))
    return [f"{s.var} missing from README's settings table" for s in SETTINGS
            if s.var not in listed and not (s.test_only or s.set_by)]  # documented with what tests or sets it


CHECKS = [readme_size_problems, readme_line_problems, dated_prose_problems, render_problems, link_problems,
          settings_problems]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_checkout(check):
    assert check(ROOT) == []


# -- each check fails on a copy broken on purpose ---------------------------------------------------------------
def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "benchmarks" / "records", root / "benchmarks" / "records")
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def _grow(root: Path) -> None:
    _edit(root / "README.md", "## Testing", "x" * 280 + "\n" + ("y" * 100 + "\n") * 40 + "\n## Testing")


def _long_line(root: Path) -> None:
    _edit(root / "README.md", "## Testing", "z" * 301 + "\n\n## Testing")


def _dated(root: Path) -> None:
    _edit(root / "docs/sections/comm.md", "\n", " measured 2026-12-05 20:34-20:48 UTC, commit ba80e72\n")


def _stale_record(root: Path) -> None:
    """A record changes (a new run) but the pages are not rendered again."""
    path = next(p for p in sorted((root / "benchmarks/records").glob("*.json")) if '"headline"' in p.read_text())
    record = json.loads(path.read_text())
    record["figures"]["summary"] = record["figures"].get("summary", "") + " (new run)"
    path.write_text(json.dumps(record))


def _hand_edited(root: Path) -> None:
    _edit(root / "README.md", "<!-- results:headline:begin -->\n", "<!-- results:headline:begin -->\nhand-written\n")


def _no_region(root: Path) -> None:
    _edit(root / "docs/sections/benchmarks.md", "<!-- results:topic:begin -->", "")


def _dead_link(root: Path) -> None:
    (root / "docs/sections/mixed.md").unlink()


def _setting_dropped(root: Path) -> None:
    text = (root / "README.md").read_text()
    (root / "README.md").write_text(re.sub(r"^\| `MEMRT_GC_FREEZE` \|.*\n", "", text, flags=re.MULTILINE))


@pytest.mark.parametrize("check, breaks", [
    (readme_size_problems, _grow), (readme_line_problems, _long_line), (dated_prose_problems, _dated),
    (render_problems, _stale_record), (render_problems, _hand_edited), (render_problems, _no_region),
    (link_problems, _dead_link), (settings_problems, _setting_dropped),
], ids=lambda x: x.__name__)
def test_check_fails_on_broken_copy(tmp_path, check, breaks):
    root = _copy(tmp_path)
    assert check(root) == []
    breaks(root)
    assert check(root) != []


def test_dated_prose_patterns():
    assert DATE.search("on 2026-12-03") and UTC_TIME.search("09:52 UTC") and UTC_TIME.search("(20:34-20:48)")
    assert COMMIT.search("commit ba80e72") and not COMMIT.search("1000003 elements") and not COMMIT.search("decade")
