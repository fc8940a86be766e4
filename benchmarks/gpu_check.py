"""memrt's device check: one run on a lent GPU (no network) gives one JSON and one text table of PASS/FAIL/SKIP rows.

    bash benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]           # the entry point (picks the python, time limit)
    python -m benchmarks.gpu_check --out DIR [--dry-run] [--limit SECONDS]

Rows, in order (each with its reason and figures; every CUDA step runs in its own process under its own
timeout, and the whole run under ``--limit``):

- ``environment``: python, torch, CUDA, cuDNN and NCCL versions, the GPU (``nvidia-smi``);
- ``cuda``: ``torch.cuda.is_available()``; without it the run FAILs (exit 1), except in ``--dry-run``
  where it and every later CUDA step is a SKIP with that reason;
- ``install``: memrt installed offline against the torch already there (``pip install --no-deps
  --no-build-isolation --no-index --use-pep517 -e .``; ``--dry-run``: pip's own ``--dry-run`` of the same command;
  when pip fails, the later steps still run, importing memrt through a path shim);
- ``imports``: a fresh process imports memrt, memrt.comm, memrt.profiling and the benchmarks;
- ``offload_budgets`` (benchmarks/gpu_steps.py): GPT 12 x 512, seq 1024: memrt.auto at 90% and 60% of the
  keep-all peak, at 0.9x checkpoint-every-block's peak with the host tier, and at the smallest feasible
  budget (from the BudgetError of ``budget=1``): gradients bitwise vs stock, peak allocated and reserved
  vs budget, step time vs checkpoint every block and ``save_on_cpu(pin_memory=True)``, pinned bytes;
- ``offload_overlap``: benchmarks/offload.py's CUDA measure (share of copy time hidden behind compute,
  pinned allocations per step, parameters after training equal);
- ``nccl``: 4 ranks on the one GPU, each its own ``NCCL_HOSTID`` (P2P, SHM, IB off; sockets on loopback),
  ``MEMRT_TOPOLOGY=0,1;2,3``: hierarchical all-reduce (1, 7, 1000003 elements; f32, bf16) and broadcast
  equal torch's, memrt's DDP hook for two steps vs plain DDP (correctness only);
- ``mixed_cluster``: benchmarks/mixed_cluster.py's CUDA + CPU check (staging, weighted DDP hook);
- ``pytest_gpu``: ``pytest -m gpu`` (SKIP when pytest is not installed there).

Exit status: 1 when any row FAILs, else 0. Results: ``DIR/gpu_check.json`` and ``DIR/gpu_check.txt``
(rewritten after every row, so a run cut short keeps what it measured), step logs in ``DIR/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["main", "Row", "STEPS"]

ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of the device check's table."""

    name: str
    """Step name (environment, cuda, install, ...)."""
    status: str
    """PASS, FAIL or SKIP."""
    reason: str = ""
    """Why (always set for FAIL and SKIP), or a one-line summary of the figures."""
    seconds: float = 0.0
    """Wall time of the step, seconds."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Measured values (bytes, seconds, versions, per-arm tables)."""


STEPS: tuple[tuple[str, float, bool], ...] = (
    # (name, own timeout in seconds, needs CUDA)
    ("imports", 40, False),
    ("offload_budgets", 130, True),
    ("nccl", 70, True),
    ("offload_overlap", 45, True),
    ("mixed_cluster", 40, True),
    ("pytest_gpu", 70, True),
)
"""The steps after environment, cuda and install; each runs in a child process under its timeout."""


class Run:
    """The rows so far, written to ``out`` after each one."""

    def __init__(self, out: Path, limit_s: float, dry_run: bool) -> None:
        self.out, self.limit_s, self.dry_run = out, limit_s, dry_run
        self.t0 = time.monotonic()
        self.rows: list[Row] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.limit_s - (time.monotonic() - self.t0)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(f"{row.status:4}  {row.name:16} {row.seconds:6.1f} s  {row.reason}", flush=True)
        self.write()
        return row

    def write(self) -> None:
        data = {"dry_run": self.dry_run, "limit_s": self.limit_s, "elapsed_s": round(time.monotonic() - self.t0, 1),
                "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                "status": "FAIL" if any(r.status == "FAIL" for r in self.rows) else "PASS",
                "rows": [asdict(r) for r in self.rows]}
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")
        (self.out / "gpu_check.txt").write_text(table(self.rows, data))


def table(rows: list[Row], data: dict[str, Any]) -> str:
    """The text table: one line per row, then each row's figures (arms of the offload step as a sub-table)."""
    lines = [f"memrt gpu_check {data['date_utc']} UTC  ({'dry run, ' if data['dry_run'] else ''}"
             f"{data['elapsed_s']:.0f} s of {data['limit_s']:.0f} s): {data['status']}", ""]
    w = max([len(r.name) for r in rows] + [4])
    lines.append(f"{'step':{w}}  {'status':6} {'secs':>6}  reason")
    lines.append(f"{'-' * w}  {'-' * 6} {'-' * 6}  {'-' * 40}")
    for r in rows:
        lines.append(f"{r.name:{w}}  {r.status:6} {r.seconds:6.1f}  {r.reason}")
    for r in rows:
        arms = r.figures.get("arms")
        if arms:
            cols = list(dict.fromkeys(k for a in arms for k in a))
            lines += ["", f"{r.name}:", "  ".join(cols)]
            lines += ["  ".join(_cell(a.get(c)) for c in cols) for a in arms]
    return "\n".join(lines) + "\n"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / 2**20:.0f}MiB"
    return str(v) if v is not None else "-"


# ---------------------------------------------------------------------------------- rows run in this process
def environment() -> Row:
    """Versions of python, torch, CUDA, cuDNN, NCCL and the GPU; never raises (a missing torch is a FAIL)."""
    fig: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "platform": platform.platform()}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - the row says why
        return Row(name="environment", status="FAIL", reason=f"import torch failed: {exc}", figures=fig)
    fig.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=bool(torch.cuda.is_available()))
    try:
        fig["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        fig["cudnn"] = None
    try:
        fig["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        fig["nccl"] = None
    import importlib.util

    fig["packages"] = {m: importlib.util.find_spec(m) is not None  # memrt's deps and what the rows use
                       for m in ("numpy", "psutil", "setuptools", "pip", "pytest", "transformers", "matplotlib")}
    if fig["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        fig.update(gpu=p.name, gpu_memory_bytes=int(p.total_memory), gpus=torch.cuda.device_count())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        fig["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        fig["nvidia_smi"] = f"unavailable ({type(exc).__name__})"
    missing = [m for m, ok in fig["packages"].items() if not ok]
    return Row(name="environment", status="PASS", figures=fig,
               reason=f"torch {fig['torch']}, CUDA {fig['cuda']}, NCCL {fig['nccl']}, {fig.get('gpu', 'no GPU')}"
                      + (f"; not installed: {', '.join(missing)}" if missing else ""))


def cuda_row(env: Row, dry_run: bool) -> Row:
    if env.figures.get("cuda_available"):
        return Row(name="cuda", status="PASS", reason=f"{env.figures.get('gpus')} device(s)")
    why = "no CUDA device: torch.cuda.is_available() is False" if "torch" in env.figures else env.reason
    return Row(name="cuda", status="SKIP" if dry_run else "FAIL",
               reason=why + ("; dry run: the CUDA steps are skipped" if dry_run else "; run this on the GPU machine"))


def install(python: str, *, dry_run: bool, timeout_s: float, log: Path) -> Row:
    """memrt installed offline (editable, no dependencies, the torch already there); dry run: pip --dry-run."""
    # --use-pep517: without it pip falls back to ``setup.py develop``, which newer setuptools turn into a
    # nested, build-isolated pip install that wants the network for setuptools itself.
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--use-pep517",
           "-e", str(ROOT)]
    if dry_run:
        cmd.insert(4, "--dry-run")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, timeout_s), env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return Row(name="install", status="FAIL", reason=f"pip did not finish within {timeout_s:.0f} s")
    log.write_text(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    if p.returncode != 0:
        shim = _path_shim(log.parent.parent / "shim")
        return Row(name="install", status="FAIL", figures={"command": " ".join(cmd), "shim": str(shim)},
                   reason=f"offline pip install failed (rc {p.returncode}): {tail[0][-160:]}; see {log}; the "
                          f"later steps import memrt.comm / memrt.profiling through a path hook ({shim})")
    return Row(name="install", status="PASS", figures={"command": " ".join(cmd), "pip": tail[0]},
               reason=("pip --dry-run: " if dry_run else "installed offline: ") + tail[0][-120:])


_SHIM = """# written by benchmarks/gpu_check.py: memrt.comm and memrt.profiling from the checkout without an install
import importlib.util, sys
_ROOT = {root!r}
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
class _MemrtSubpackages:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in ("memrt.comm", "memrt.profiling"):
            d = _ROOT + "/" + name.split(".")[1]
            return importlib.util.spec_from_file_location(name, d + "/__init__.py", submodule_search_locations=[d])
        return None
sys.meta_path.insert(0, _MemrtSubpackages)
"""


def _path_shim(folder: Path) -> Path:
    """A ``sitecustomize`` on PYTHONPATH (this process's children inherit it) that maps memrt.comm and
    memrt.profiling to the checkout's comm/ and profiling/, as setup.py's package_dir does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SHIM.format(root=str(ROOT)))
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(folder) + (os.pathsep + old if old else "")  # for the steps' processes
    return folder


def run_step(run: Run, name: str, own_s: float, python: str) -> Row:
    """``python -m benchmarks.gpu_check --step NAME`` under min(own timeout, time left); its JSON is the row."""
    budget = min(own_s, run.left() - 5.0)
    if budget < 10.0:
        return Row(name=name, status="SKIP", reason=f"out of time: {max(0.0, run.left()):.0f} s of the run's limit left")
    result = run.out / "logs" / f"{name}.json"
    result.unlink(missing_ok=True)
    log = run.out / "logs" / f"{name}.log"
    cmd = [python, "-m", "benchmarks.gpu_check", "--step", name, "--out", str(run.out)]
    t0 = time.monotonic()
    with open(log, "w") as fh:
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # deterministic cuBLAS: bitwise comparisons
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Row(name=name, status="FAIL", seconds=time.monotonic() - t0,
                       reason=f"timed out after {budget:.0f} s (step limit); last output: {_tail(log)}")
    secs = time.monotonic() - t0
    if result.exists():
        d = json.loads(result.read_text())
        return Row(name=name, status=d["status"], reason=d.get("reason", ""), seconds=secs,
                   figures=d.get("figures", {}))
    return Row(name=name, status="FAIL", seconds=secs, reason=f"step exited {rc} without a result: {_tail(log)}")


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group: its ranks and pytest children too
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _tail(path: Path, n: int = 300) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    return " | ".join(text[-n:].splitlines()[-4:]) or "(empty log)"


# ---------------------------------------------------------------------------------- one step, in a child process
def step_main(name: str, out: Path) -> int:
    """Run one step; write ``out/logs/<name>.json``."""
    from benchmarks import gpu_steps

    fn = getattr(gpu_steps, f"step_{name}")
    try:
        status, reason, figures = fn(out)
    except Exception as exc:  # noqa: BLE001 - the row says what broke
        import traceback

        traceback.print_exc()
        status, reason, figures = "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}", {}
    path = out / "logs" / f"{name}.json"
    path.write_text(json.dumps({"status": status, "reason": reason, "figures": figures}, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="memrt's device check (see benchmarks/gpu_check.sh)")
    p.add_argument("--out", default="gpu-check", help="folder for gpu_check.json / .txt and logs/")
    p.add_argument("--dry-run", action="store_true", help="CPU: skip the CUDA steps with the reason, pip --dry-run")
    p.add_argument("--limit", type=float, default=390.0, help="seconds for the whole run (<= 405)")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    if args.step:
        return step_main(args.step, out)
    if not 30 <= args.limit <= 405:
        p.error(f"--limit={args.limit} is not valid: expected 30..405 seconds (the device slot is 6 minutes)")
    run = Run(out, args.limit, args.dry_run)
    t = time.monotonic()
    env = run.add(_timed(environment(), t))
    cuda = run.add(cuda_row(env, args.dry_run))
    if env.status == "FAIL" or cuda.status == "FAIL":
        why = f"not run: {cuda.reason if env.status != 'FAIL' else env.reason}"
        for name in ["install"] + [n for n, _, _ in STEPS]:
            run.add(Row(name=name, status="SKIP", reason=why))
        return 1
    t = time.monotonic()
    inst = run.add(_timed(install(sys.executable, dry_run=args.dry_run, timeout_s=min(60.0, run.left() - 5),
                                  log=out / "logs" / "install.log"), t))
    for name, own_s, needs_cuda in STEPS:
        if needs_cuda and cuda.status != "PASS":
            run.add(Row(name=name, status="SKIP", reason=f"needs CUDA: {cuda.reason}"))
        else:  # after a failed install the steps import memrt through the install row's path shim
            run.add(run_step(run, name, own_s, sys.executable))
    run.write()
    bad = [r.name for r in run.rows if r.status == "FAIL"]
    print(f"gpu_check: {'FAIL (' + ', '.join(bad) + ')' if bad else 'no FAIL'}; table {out / 'gpu_check.txt'}")
    return 1 if bad else 0


def _timed(row: Row, t0: float) -> Row:
    row.seconds = time.monotonic() - t0
    return row


if __name__ == "__main__":
    sys.exit(main())
