"""``memrt report DIR --html``: one self-contained page, opened in real headless Chromium.

A real run writes the report folder: benchmarks/balance_job.py (an unchanged DDP + DistributedSampler job)
under ``MEMRT=1 torchrun`` with 2 ranks, a byte budget (a memory plan) and rank 1 slowed (balance decisions).
``memrt report DIR --html`` then writes ``report.html``, which must:

- fetch nothing: no ``http(s)://`` or protocol-relative ``src``/``href``/``url()``, no scripts; every plot an
  inline PNG that Chromium decodes (checked from a page that loads the report in an iframe);
- load in Chromium with no console message (the page has no script: any message is an error);
- show as text the key numbers, computed here from the rank files: each rank's peak and budget, the bytes
  sent per tier, the plan's predicted and measured peaks, the balance shares in force;
- render to a screenshot that is not blank.

A fast test renders a sparse file (one rank, no collectives, no plan, malformed balance decisions, which the
rank-file checks do not cover) to ``--output`` in a new folder: every section says what is missing.

Chromium is looked for on PATH; when missing and running as root with apt-get, it is installed once
(``apt-get install -y chromium``). Without it the test fails under ``CI=true`` and skips otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest

from memrt.testing import venv_bin

JOB = Path(__file__).resolve().parent.parent / "benchmarks" / "balance_job.py"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BUDGET = "6MiB"
WINDOW = (1400, 3000)
_CHECK_PAGE = """<!DOCTYPE html><html><body><pre id="result">pending</pre>
<iframe id="f" src="report.html" width="1400" height="3000"></iframe>
<script>
document.getElementById("f").addEventListener("load", () => {
  let out;
  try {
    const doc = document.getElementById("f").contentDocument;
    const imgs = Array.from(doc.images);
    out = {images: imgs.length, decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
           text: doc.body.innerText};
  } catch (e) { out = {error: String(e)}; }
  document.getElementById("result").textContent = "RESULT:" + btoa(unescape(encodeURIComponent(JSON.stringify(out))));
});
</script></body></html>
"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    """A Chromium binary: on PATH, else installed with apt-get when root; else fail in CI, skip elsewhere."""
    found = _find_browser()
    why = "no chromium, chromium-browser or google-chrome on PATH"
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            try:
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                why += f"; {' '.join(argv)} timed out"
                break
            if proc.returncode != 0:
                why += f"; {' '.join(argv)} failed: {(proc.stderr or proc.stdout)[-500:]}"
                break
        found = _find_browser()
    elif found is None:
        why += " (not root or no apt-get: install it with apt-get install -y chromium)"
    if found is None:
        if _in_ci():
            pytest.fail(f"CI needs Chromium for the HTML report test: {why}")
        pytest.skip(f"Chromium not available: {why}")
    return found


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    """A real report folder: 2-rank MEMRT=1 DDP job with a budget and a slowed rank (about 7 s idle)."""
    tmp = tmp_path_factory.mktemp("html-report")
    reports = tmp / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRT", "BALANCE_JOB"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MEMRT="1", MEMRT_BUDGET=BUDGET, MEMRT_REPORT_DIR=str(reports), BALANCE_JOB_DELAY="1=0.0006",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(JOB), "--samples", "602",
            "--batch", "16", "--steps", "30", "--warmup", "0", "--width", "256", "--out", str(tmp / "job")]
    proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert sorted(p.name for p in reports.glob("rank*.json")) == ["rank0.json", "rank1.json"], proc.stderr[-5000:]
    return reports


class _Refs(HTMLParser):
    """Every tag with its attributes, and the text of <style>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.style = ""
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.style += data


def _run_browser(browser: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [browser, "--headless=new", "--disable-gpu", "--no-sandbox", "--no-first-run", "--mute-audio",
            f"--user-data-dir={cwd / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=5000", *args]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def _console(stderr: str) -> list[str]:
    """Console messages and failed loads Chromium logged (its own D-Bus/GPU warnings are not about the page)."""
    return [line for line in stderr.splitlines()
            if ":CONSOLE" in line or "Failed to load resource" in line or "net::ERR_" in line]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a first apt-get install of Chromium on a loaded machine takes minutes
def test_html_report_is_self_contained_and_renders_in_chromium(report_dir, chromium, tmp_path):
    import base64

    import matplotlib.image as mpimg

    from memrt.cli import main
    from memrt.sizes import format_bytes

    out = tmp_path / "out"
    assert main(["report", str(report_dir), "--out", str(out), "--no-traces", "--html"]) == 0
    page = out / "report.html"
    assert stat.S_IMODE(page.stat().st_mode) == 0o600  # like every file memrt writes for a report
    text = page.read_text()

    # nothing fetched: no scripts, no external src/href/url(), every image inline PNG
    refs = _Refs()
    refs.feed(text)
    assert not [t for t, _ in refs.tags if t in ("script", "link", "iframe", "object", "embed")], refs.tags
    external = [(t, k, v) for t, attrs in refs.tags for k, v in attrs.items()
                if k in ("src", "href", "srcset", "poster", "data") and re.match(r"\s*(https?:)?//", v, re.I)]
    assert external == []
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)
    assert not re.search(r"url\(|@import", refs.style)
    images = [attrs["src"] for tag, attrs in refs.tags if tag == "img"]
    # memory per rank (2), step split, comm time per size, balance shares, plan (one per distinct plan)
    assert len(images) >= 6, len(images)
    for src in images:
        assert src.startswith("data:image/png;base64,"), src[:60]
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"

    # the figures the page must show as text, from the rank files and the JSON twin
    ranks = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    report = json.loads((out / "report.json").read_text())
    expected = [f"memrt report | run {report['run_id']}", "Key numbers", "Memory per rank", "Step time per rank",
                "Communication per tier and algorithm", "Balance shares over time", "Plan per unit"]
    tiers: dict[str, int] = defaultdict(int)
    for data in ranks:
        peak = max(e["live_bytes"] for e in data["memory"])
        expected += [format_bytes(peak), format_bytes(report["budgets"][str(data["rank"])])]
        for record in data["comm"]:
            for tier, n in record["tier_bytes"].items():
                tiers[tier] += n
        plan = report["plans"][str(data["rank"])]  # the rank's last plan, as the text report shows it
        expected += [format_bytes(plan["predicted_peak_bytes"]), format_bytes(plan["measured_peak_bytes"])]
    assert report["budgets"]["0"] == 6 * 2**20  # MEMRT_BUDGET=6MiB on every rank
    assert tiers["intra"] > 0  # one node: the ring stays inside it
    expected += [format_bytes(n) for n in tiers.values()]
    balance = ranks[0]["meta"]["activation"]["balance"]
    assert balance["shares"], "the slowed rank was never balanced"
    expected.append(str(balance["shares"]))

    # real Chromium: the page loads without console messages and every image decodes
    (out / "check.html").write_text(_CHECK_PAGE)
    dom = _run_browser(chromium, "--allow-file-access-from-files", "--dump-dom", (out / "check.html").as_uri(),
                       cwd=tmp_path)
    assert _console(dom.stderr) == [], _console(dom.stderr)
    found = re.search(r"RESULT:([A-Za-z0-9+/=]+)", dom.stdout)
    assert found, dom.stdout[-2000:]
    result = json.loads(base64.b64decode(found.group(1)).decode())
    assert "error" not in result, result
    assert result["images"] == len(images) and result["decoded"] == len(images), result
    rendered = result["text"]
    missing = [s for s in expected if s not in rendered]
    assert missing == [], f"not shown on the page: {missing}"

    shot = tmp_path / "shot.png"
    proc = _run_browser(chromium, f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}", page.as_uri(),
                        cwd=tmp_path)
    assert _console(proc.stderr) == [], _console(proc.stderr)
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0]), pixels.shape
    rgb = pixels[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05, "blank screenshot"
    colours = {tuple(c) for c in (rgb[:: 97] * 255).astype(int).tolist()}
    assert len(colours) > 50, f"only {len(colours)} colours: the plots did not render"
    print(f"screenshot: {shot}", file=sys.stderr)  # pytest -s shows where to look at it


def test_sparse_rank_file_renders_every_section(tmp_path, capsys):
    from memrt.cli import main

    d = tmp_path / "run"
    d.mkdir()
    decisions = [None, {"step": "x"}, {"step": 3, "samples_per_s": "fast", "shares": [1, "a"], "predicted_gain": None}]
    rank = {"schema": 1, "rank": 0, "comm": [], "trace": [], "plans": [],
            "memory": [{"t": 0.0, "live_bytes": 100, "kind": "step_begin"},
                       {"t": 0.1, "live_bytes": 300, "kind": "sample"},
                       {"t": 0.2, "live_bytes": 150, "kind": "step_end"}],
            "meta": {"activation": {"balance": {"decisions": decisions}, "seconds": float("nan")}}}
    (d / "rank0.json").write_text(json.dumps(rank))
    page = tmp_path / "new" / "folder" / "page.html"
    assert main(["report", str(d), "--no-traces", "--output", str(page)]) == 0  # --output implies --html
    capsys.readouterr()
    text = page.read_text()
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    for needle in ("Memory per rank", "300 B", "(no collectives recorded)", "No memory plan recorded",
                   "memory timeline steps", "Balance shares over time", "Text report"):
        assert needle in text, needle
    assert "<script" not in text and not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)
