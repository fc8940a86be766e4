"""`memrt demo` (the README's main job) and the activation example, run briefly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memrt.testing import venv_bin

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "activation_unchanged_ddp.py"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env.update(OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def test_demo_side_by_side(tmp_path):
    # an empty cache directory, as on a new machine: memrt probes the disk during the run (and must not
    # draw from the training's generators while doing so: the parameters must still be bitwise equal)
    out = subprocess.run([venv_bin("memrt"), "demo", "--steps", "4", "--json", "demo.json"],
                         env=_env(XDG_CACHE_HOME=str(tmp_path / "empty-cache")), cwd=tmp_path,
                         capture_output=True, text=True, timeout=400)
    text = out.stdout
    assert out.returncode == 0, text[-3000:] + out.stderr[-3000:]
    for row in ("peak memory, 1 step", "budget (MEMRT_BUDGET)", "tokens/s (all ranks)", "all-reduce bytes sent",
                "parameters equal on every rank", "memrt's plan on rank 0"):
        assert row in text, f"missing row {row!r}:\n{text}"
    assert text.count("memrt 0.1.0 on |") == 1
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["parameters_equal"] is True, text[-3000:]
    assert any((tmp_path / "empty-cache").rglob("*.json")), "the demo did not probe (and cache) on the new machine"
    peak_stock, peak_memrt = result["peak_bytes"]
    assert peak_memrt <= result["budget_bytes"] < peak_stock, result["peak_bytes"]
    plan = result["memrt"][0]["plan"]
    assert plan is not None and any(u["action"] != "keep" for u in plan["units"])
    assert all(r > 0 for r in result["tokens_per_s"])
    assert list((tmp_path / "memrt-report").glob("demo-*/rank0.json"))


@pytest.mark.mpi
def test_example_under_memrt_run_and_mpiexec(tmp_path):
    """The example's third launch command, through `memrt run` (its sitecustomize) and mpiexec."""
    argv = [venv_bin("memrt"), "run", "--budget", "85%", "--", venv_bin("mpiexec"), "-n", "2", sys.executable,
            str(EXAMPLE), "--steps", "3", "--batch", "8"]
    out = subprocess.run(argv, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "step 2 loss" in text and text.count("memrt 0.1.0 on |") == 1
    assert "MEMRT_BUDGET       85%" in text and "launcher mpich" in text
    reports = list((tmp_path / "memrt-report").glob("*/rank*.json"))
    assert sorted(p.name for p in reports) == ["rank0.json", "rank1.json"]
