"""``memrt plan -- <command>``: a job's memory frontier from its first steps, then the job stops.

On two unchanged single-process jobs (tests/scripts/single_jobs.py ``loop``: a small GPT with dropout and
AdamW; tests/scripts/single_hf_trainer.py: HF ``Trainer`` on a random-init GPT-2), the frontier is printed
and kept (``--json``), the job stops after its profiled step (no ``params.pt``); then the job runs under
``MEMRT=1`` at three budgets of the frontier, and the peak each run measured (the certified step, memrt's
report) is within 10% of what the frontier predicted at that budget. Plans of recomputation only
(``MEMRT_OFFLOAD=none``): with the disk tier the measured resident peak holds the tier's I/O buffers, which the
planner's model leaves out (docs/sections/memory.md). Bad input: one line naming the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _script_runs import ScriptRuns
from memrt.activation.plan import _budgets
from memrt.memory.frontier import spread_budgets
from memrt.testing import venv_bin

SCRIPTS = Path(__file__).parent / "scripts"
JOBS = {"loop": [str(SCRIPTS / "single_jobs.py"), "loop", "--steps", "5"],
        "hf": [str(SCRIPTS / "single_hf_trainer.py"), "--steps", "4"]}
TOLERANCE = 0.10
OFFLOAD = "none"
"""Plans of recomputation only (the disk tier's I/O buffers are memory outside the planner's model: see below)."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _plan(tmp: Path, job: str, *options: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    folder = tmp / f"plan-{job}"
    folder.mkdir()
    out = folder / "frontier.json"
    proc = subprocess.run([venv_bin("memrt"), "plan", *options, "--json", str(out), "--", sys.executable, *JOBS[job],
                           "--out", "params.pt"], env=_env(), cwd=folder, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (folder / "params.pt").exists(), "the job went on after its frontier was written"
    return proc, json.loads(out.read_text())


def _measured_peak(folder: Path) -> int:
    (run,) = list((folder / "memrt-report").iterdir())
    act = json.loads((run / "rank0.json").read_text())["meta"]["activation"]
    (plan,) = act["plans"]
    assert plan["measured_peak_bytes"] is not None, plan
    return plan["measured_peak_bytes"]


@pytest.mark.alone  # the peaks are the process's high-water mark (VmHWM), 12% off once beside another test
@pytest.mark.slow
def test_frontier_predicts_the_peaks_the_job_then_measures(tmp_path):
    rows_by_job = {}
    for job in JOBS:
        proc, ranks = _plan(tmp_path, job, "--offload", OFFLOAD)
        assert "memrt plan | rank 0 |" in proc.stdout and "smallest feasible budget" in proc.stdout, proc.stdout
        (rank0,) = ranks
        (model,) = rank0["models"]
        front = model["frontier"]
        assert front["min_feasible_bytes"] < front["keep_all_peak_bytes"], front
        feasible = [r for r in front["rows"] if r["feasible"]]
        assert len(feasible) == len(front["rows"]) >= 3, front["rows"]  # spread from the smallest feasible budget
        assert all(r["predicted_peak_bytes"] <= r["budget_bytes"] for r in feasible), feasible
        assert feasible[0]["recomputed"] + feasible[0]["offloaded"] > 0 and feasible[-1]["kept"] == front["units"]
        # three budgets below keep-all: the smallest feasible, the middle of the range, the last before keep-all
        picked = [feasible[0], feasible[len(feasible) // 2], feasible[-2]]
        rows_by_job[job] = picked
    runs = ScriptRuns(tmp_path / "runs", {f"{job} {i}": (JOBS[job], {"MEMRT": "1", "MEMRT_BUDGET": str(r["budget_bytes"]),
                                                                      "MEMRT_OFFLOAD": OFFLOAD})
                                          for job, rows in rows_by_job.items() for i, r in enumerate(rows)},
                      _env, timeout=300)
    try:
        report = []
        for job, rows in rows_by_job.items():
            for i, row in enumerate(rows):
                _, folder = runs.get(f"{job} {i}")
                measured = _measured_peak(folder)
                report.append((job, row["budget_bytes"], row["predicted_peak_bytes"], measured))
        for job, budget, predicted, measured in report:
            assert abs(measured / predicted - 1) <= TOLERANCE, (job, budget, predicted, measured, report)
    finally:
        runs.close()


@pytest.mark.slow
def test_a_job_that_never_trains_has_no_frontier(tmp_path):
    proc = subprocess.run([venv_bin("memrt"), "plan", "--", sys.executable, "-c", "print('no training')"],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no training" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("memrt plan: the command ended (exit 0)"), proc.stderr


def test_bad_budgets_name_the_option():
    with pytest.raises(Exception, match="--budgets"):
        _budgets("60%,lots")
    with pytest.raises(ValueError, match="--budgets"):
        _budgets(" , ")
    assert _budgets("60%,1GiB") == ["60%", "1GiB"] and _budgets(None) is None
    proc = subprocess.run([venv_bin("memrt"), "plan", "--budgets", "lots", "--", "true"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--budgets" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_budgets_spread_from_the_floor_to_keep_all():
    assert spread_budgets(100, 200, 6) == [100, 120, 140, 160, 180, 200]
    assert spread_budgets(100, 100, 6) == [100]
