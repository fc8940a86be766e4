"""Shared helpers for memrt's benchmarks: machine line, timing, peak memory, tables, ratios, JSON + PNG.

Every benchmark prints one machine line first (date, cores, memory, load, torch version), measures each
arm and its named baseline in the same run, prints ratios against that baseline, and writes
``<out>/<name>.json`` (and a PNG where it has a figure).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from memrt.config import environ
from memrt.sizes import format_bytes
from memrt.launcher import free_port

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "PeakRss",
    "base_parser",
    "ensure_mmap_threshold",
    "format_bytes",
    "fmt_ratio",
    "machine_info",
    "machine_line",
    "median_seconds",
    "print_table",
    "save_plot",
    "skip_line",
    "write_json",
    "write_record",
    "free_port",
    "launch_on_nodes",
    "result_lines",
]

MMAP_THRESHOLD_BYTES = 65536
"""glibc serves allocations above this size with mmap, so a freed tensor leaves the RSS at once and the
process's peak RSS tracks its peak live tensor bytes (the outside measure of the memory budget)."""


def machine_info() -> dict[str, Any]:
    """Date (UTC), cores, memory, load average and versions: the provenance of every table."""
    import torch

    try:
        import psutil

        mem_gib = psutil.virtual_memory().total / 2**30
    except ImportError:  # pragma: no cover - psutil is a dependency of the venv
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "load_avg_1m": round(load[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": " ".join([Path(sys.executable).name, "-m", _module_name(), *sys.argv[1:]]),
    }


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else (sys.argv[0] if sys.argv else "?")


def machine_line(info: dict[str, Any]) -> str:
    dev = info["cuda"] or "CPU"
    line = (f"# {info['date_utc']} | {info['cores']} cores, {info['memory_gib']} GiB, load {info['load_avg_1m']} "
            f"| torch {info['torch']} {dev} | python {info['python']}")
    if info["cores"] and info["load_avg_1m"] > 0.5 * info["cores"]:
        line += "\n# note: machine under load (load average > half the cores): timings are noisy; ratios are side by side"
    return line


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 60 s)")
    p.add_argument("--out", default="benchmark-results", help="directory for the JSON and PNG (default: %(default)s)")
    return p


def ensure_mmap_threshold() -> None:
    """Re-exec this process with ``MALLOC_MMAP_THRESHOLD_`` set so that :class:`PeakRss` is exact.

    glibc reads the variable only at start-up, hence the re-exec (once; the variable marks it done).
    """
    env = environ()
    if env.get("MALLOC_MMAP_THRESHOLD_") == str(MMAP_THRESHOLD_BYTES) or not sys.platform.startswith("linux"):
        return
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    sys.stdout.flush()
    argv = [sys.executable, "-m", _module_name(), *sys.argv[1:]]
    os.execve(sys.executable, argv, env)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status (Linux only)")


class PeakRss:
    """Peak resident bytes above the start, over a ``with`` block: Linux ``VmHWM`` after resetting it.

    Writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark to the current RSS (Linux >= 4.0),
    so consecutive arms in one process each get their own peak. With :func:`ensure_mmap_threshold` a freed
    tensor returns its pages at once, so this is the peak of live tensor bytes, measured from outside torch.
    """

    def __init__(self) -> None:
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> "PeakRss":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_bytes = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak_bytes = _status_bytes("VmHWM")

    @property
    def delta_bytes(self) -> int:
        """Peak above the RSS at entry (what the step allocated on top of what was already live)."""
        return max(0, self.peak_bytes - self.start_bytes)


def median_seconds(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup`` calls; also every sample."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None) -> str:
    """Print (and return) a GitHub-markdown table, so output pastes straight into the README."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"\n## {title}")
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def skip_line(arm: str, reason: str) -> dict[str, str]:
    """Print that ``arm`` is skipped and why (never silently); return the record for the JSON.

    Only for a requirement this machine lacks, named in ``reason`` (root, a GPU, a package): an arm
    that raises is a failure (:func:`fail_line`), never a skip."""
    print(f"SKIP {arm}: {reason}", flush=True)
    return {"arm": arm, "skipped": reason}


_FAILURES: list[dict[str, str]] = []


def fail_line(arm: str, reason: str) -> dict[str, str]:
    """Print that ``arm`` failed and why; the benchmark then exits non-zero (:func:`exit_code`)."""
    print(f"FAIL {arm}: {reason}", flush=True)
    record = {"arm": arm, "failed": reason}
    _FAILURES.append(record)
    return record


def failures() -> list[dict[str, str]]:
    """Every :func:`fail_line` of this process."""
    return list(_FAILURES)


def exit_code() -> int:
    """1 when any arm failed (printed FAIL), else 0."""
    if _FAILURES:
        print(f"{len(_FAILURES)} arm(s) FAILED: {', '.join(f['arm'] for f in _FAILURES)}", flush=True)
        return 1
    return 0


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def write_json(out_dir: str | os.PathLike, name: str, payload: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=_jsonable, allow_nan=False))
    print(f"wrote {path}", flush=True)
    return path


RECORDS_DIR = Path(__file__).resolve().parent / "records"
"""Committed results records, the source of every results table in README.md and docs (benchmarks/render.py)."""


def write_record(rid: str, *, benchmark: str, topic: str, claim: str, figures: dict[str, Any], baseline: str,
                 info: dict[str, Any], target: str | None = None, tables: list[dict[str, Any]] | None = None,
                 out_dir: str | os.PathLike = RECORDS_DIR) -> Path:
    """Write one results record (``<out_dir>/<rid>-<date>.json``) for ``python -m benchmarks.render``.

    ``figures`` needs a one-line ``detail`` (and a ``summary`` for the README's headline table); ``info`` is
    :func:`machine_info` of the run; ``tables``: full tables (``title``, ``headers``, ``rows``) for a page's
    ``results:tables:<id>`` region. The commit is ``git rev-parse --short HEAD`` of this checkout, or None.
    """
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        commit = None
    date = info["date_utc"].split()[0]
    machine = f"{info['cuda'] or 'no GPU'}, {info['cores']} cores, {info['memory_gib']} GiB, Python {info['python']}"
    record = {"id": rid, "benchmark": benchmark, "topic": topic, "claim": claim, "machine": machine,
              "torch": info["torch"], "commit": commit, "date": date, "figures": figures, "baseline": baseline,
              "target": target, "command": info["command"], "source": "written by the benchmark"}
    if tables:
        record["tables"] = tables
    return write_json(out_dir, f"{rid}-{date}", record)


def save_plot(out_dir: str | os.PathLike, name: str, draw: Callable[[Any], None]) -> Path | None:
    """``draw(plt)`` then save ``<out>/<name>.png``; prints a reason and returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("SKIP plot: matplotlib not installed (pip install matplotlib)")
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    plt.figure(figsize=(8, 5))
    draw(plt)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    print(f"wrote {path}", flush=True)
    return path


# ---------------------------------------------------------------- launching ranks ----
def launch_on_nodes(argv: Sequence[str], *, nodes: Sequence[Sequence[int]], cluster: Any = None,
                    env: dict[str, str] | None = None, timeout_s: float = 600.0,
                    rank_env: Callable[[int], dict[str, str]] | None = None) -> list[tuple[int, str, str]]:
    """(rc, stdout, stderr) per rank of ``argv`` started on ``nodes`` (rank lists, numbered node by node) by
    :func:`memrt.testing.launch.launch_ranks` (torchrun's variables; ``cluster``: node i in namespace i).
    Raises TimeoutError when the ranks run past ``timeout_s``."""
    from memrt.testing.launch import launch_ranks as launch

    if [r for n in nodes for r in n] != list(range(sum(len(n) for n in nodes))):
        raise ValueError(f"nodes={nodes!r}: ranks must be numbered node by node from 0")
    results = launch(argv, ranks_per_node=[len(n) for n in nodes], cluster=cluster, env=env, rank_env=rank_env,
                     timeout_s=timeout_s, check=False)
    if any(r.timed_out for r in results):
        raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s: "
                           + "; ".join(f"rank {r.rank}: {r.stderr[-300:]}" for r in results))
    return [(r.returncode, r.stdout, r.stderr) for r in results]


def result_lines(outputs: Sequence[tuple[int, str, str]], tag: str = "RESULT ") -> list[dict[str, Any]]:
    """Parse the ``RESULT {json}`` lines every rank printed; raise with the failing rank's stderr."""
    bad = [(i, rc, err) for i, (rc, _, err) in enumerate(outputs) if rc != 0]
    if bad:  # the rank that failed first, not one killed because it did (SIGKILL from the launcher)
        i, rc, err = next((b for b in bad if b[1] != -9), bad[0])
        raise RuntimeError(f"rank {i} exited {rc}: {err.strip()[-1500:]}")
    found = []
    for _, out, _ in outputs:
        found += [json.loads(line[len(tag):]) for line in out.splitlines() if line.startswith(tag)]
    return found
