"""PyTorch's own distributed test suite, run with its ``dist`` pointed at memrt.comm.

``torch.testing._internal.distributed.distributed_test`` (shipped in the torch wheel) is driven as
PyTorch drives it (BACKEND=gloo, WORLD_SIZE=4, TEMP_DIR; tests/scripts/torch_dist_suite.py), once with
its ``dist`` = torch.distributed (stock) and once = memrt.comm, on 4 gloo ranks with MEMRT_TOPOLOGY
faking two nodes (0,1;2,3). Selected: every all_reduce / broadcast / all_gather / reduce_scatter /
barrier test, coalesced variants included. A test that passes on stock must pass through memrt.comm,
and the suite skips the same tests on both (the skipped ones are printed with the suite's reason).
Its profiler checks (``call_dist_op``) need one event named ``gloo:<op>`` per user call, with the
user's shapes. memrt.comm runs twice: MEMRT_COMM=auto (small tensors: torch's flat path, plus
memrt's fusion of async and coalesced calls) and MEMRT_COMM=hier (every call hierarchical).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).parent / "scripts" / "torch_dist_suite.py"
SELECT = re.compile(r"^test_(all_reduce|broadcast|all_gather|reduce_scatter|barrier)")
TIMEOUT_S = 270
COMMS = ("auto", "hier")

pytestmark = pytest.mark.slow


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMRT", "TORCH_DISTRIBUTED_DEBUG")) and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    temp = tmp / "suite-temp"
    temp.mkdir(exist_ok=True)
    env.update(BACKEND="gloo", WORLD_SIZE="4", TEMP_DIR=str(temp), OMP_NUM_THREADS="1",
               MEMRT_TOPOLOGY="0,1;2,3", MEMRT_REPORT_DIR=str(tmp / "memrt"), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start(via: str, names: list[str], tmp: Path, **extra: str) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{via}.json"
    argv = [sys.executable, str(RUNNER), "--via", via, "--out", str(out), *names]
    return subprocess.Popen(argv, env=_env(tmp, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True), out


def _finish(label: str, proc: subprocess.Popen, out: Path) -> dict[str, dict[str, str]]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the suite via {label} did not finish within {TIMEOUT_S}s:\n{(err or '')[-4000:]}")
    assert proc.returncode == 0 and out.exists(), f"{label}:\n{err[-4000:]}"
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="module")
def names(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("list")
    proc = subprocess.run([sys.executable, str(RUNNER), "--via", "torch", "--out", str(tmp / "x"), "--list"],
                          env=_env(tmp), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    selected = [n for n in proc.stdout.split() if SELECT.match(n)]
    # the checks that caught memrt's profiler events: they must be among the selected tests
    for must in ("test_all_reduce_sum_async", "test_all_reduce_coalesced_sum", "test_broadcast", "test_all_gather",
                 "test_barrier"):
        assert must in selected, f"{must} is not in this torch's distributed suite: {selected}"
    return selected


@pytest.fixture(scope="module")
def runs(names, tmp_path_factory) -> dict[str, dict[str, dict[str, str]]]:
    """The suite on stock gloo and through memrt.comm (MEMRT_COMM=auto and hier), run side by side: each
    run spends most of its time starting processes and in the suite's polling barriers, not on the cores."""
    started = {"stock": _start("torch", names, tmp_path_factory.mktemp("stock")),
               **{comm: _start("memrt", names, tmp_path_factory.mktemp(comm), MEMRT_COMM=comm) for comm in COMMS}}
    results = {label: _finish(label, proc, out) for label, (proc, out) in started.items()}
    stock = results["stock"]
    assert set(stock) == set(names)
    passed = [n for n, r in stock.items() if r["outcome"] == "pass"]
    assert len(passed) >= 20, f"stock gloo passes only {passed}: the suite did not run as intended"
    skipped = sorted((n, r["detail"]) for n, r in stock.items() if r["outcome"] == "skip")
    print(f"\nPyTorch distributed suite on 4 gloo CPU ranks: {len(names)} tests selected, {len(passed)} pass on "
          f"stock, {len(skipped)} skipped by the suite on CPU:")
    for n, why in skipped:
        print(f"  {n}: {why}")
    return results


@pytest.mark.parametrize("comm", COMMS)
def test_suite_passes_through_memrt_comm(runs, names, comm):
    stock, mine = runs["stock"], runs[comm]
    assert set(mine) == set(names)
    broken = {n: mine[n]["detail"][-1500:] for n, r in stock.items()
              if r["outcome"] == "pass" and mine[n]["outcome"] != "pass"}
    assert not broken, f"pass on stock gloo, not through memrt.comm (MEMRT_COMM={comm}):\n" + \
        "\n".join(f"--- {n}\n{d}" for n, d in broken.items())
    skipped = {n for n, r in stock.items() if r["outcome"] == "skip"}
    assert {n for n, r in mine.items() if r["outcome"] == "skip"} == skipped
