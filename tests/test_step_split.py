"""The exit summary's step-time table: each part where the job spent its time, the step as the job measures it.

An unchanged 2-rank DDP job (tests/scripts/step_split_job.py) under MEMRT=1 with known waits: loading a batch
(``data``) and the script's own work after ``optimizer.step()`` (``other``). The summary's mean step equals the
mean gap between the job's own optimizer-step ends (same steps) within 5%; the parts add up to the step; the
known waits land in their parts (rank 1's slower forward is rank 0's wait for the slowest rank); the gradient
path column names memrt's process group. The sample in
docs/sections/profiling.md has the headers a run prints.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from memrt.activation.report import STEP_HEADER, SUMMARY_HEADER
from memrt.activation.steptime import SKIP, StepClock, split_grad_wait
from memrt.testing import venv_bin

SCRIPT = Path(__file__).parent / "scripts" / "step_split_job.py"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "sections" / "profiling.md"
STEPS = 12


def test_clock_puts_each_moment_in_one_part():
    clock = StepClock()
    fake = iter([0.0, 1.0, 2.0, 2.5, 5.0, 6.0, 7.0, 8.0, 10.0, 10.5, 13.0, 14.0, 15.0])
    import memrt.activation.steptime as steptime

    real = steptime.time.perf_counter
    steptime.time.perf_counter = lambda: next(fake)
    try:
        opt = object()
        clock.start()                                   # 0
        for _ in range(2):
            clock.data_begin()
            clock.data_end()
            clock.forward_begin()
            clock.forward_end()
            clock.optimizer_begin(opt)
            clock.optimizer_end(opt)
    finally:
        steptime.time.perf_counter = real
    # step 1: 0-1 other, 1-2 data, 2-2.5 other, 2.5-5 forward, 5-6 backward, 6-7 optimizer
    assert clock.steps[0] == {"other": 1.5, "data": 1.0, "forward": 2.5, "backward": 1.0, "grad_wait": 0.0,
                              "optimizer": 1.0, "step": 7.0}
    # step 2: 7-8 other, 8-10 data, 10-10.5 other, 10.5-13 forward, 13-14 backward, 14-15 optimizer
    assert clock.steps[1] == {"other": 1.5, "data": 2.0, "forward": 2.5, "backward": 1.0, "grad_wait": 0.0,
                              "optimizer": 1.0, "step": 8.0}
    assert clock.summary()["step"] == 7.5 and clock.summary()["steps"] == 2


def test_backward_ends_at_the_last_gradient_and_the_rest_is_grad_wait():
    clock = StepClock()
    fake = iter([0.0, 1.0, 2.0, 4.0, 5.0, 7.0, 8.0])
    import memrt.activation.steptime as steptime

    real = steptime.time.perf_counter
    steptime.time.perf_counter = lambda: next(fake)
    try:
        opt = object()
        clock.start()                        # 0
        clock.optimizer_begin(opt)           # 1: the first step's end marks the start
        clock.optimizer_end(opt)             # 2
        clock.forward_begin()                # 4 (2-4 other)
        clock.forward_end()                  # 5
        clock.grad_ready()                   # 7: the last gradient
        clock.optimizer_begin(opt)           # 8
    finally:
        steptime.time.perf_counter = real
    assert clock._current["backward"] == 2.0 and clock._current["grad_wait"] == 1.0


def test_grad_wait_splits_into_exposed_comm_and_waiting_for_the_slowest_rank():
    fast = {"step": 0.100, "grad_wait": 0.030}   # its own work: 70 ms
    slow = {"step": 0.100, "grad_wait": 0.010}   # 90 ms: the slowest
    (exposed0, wait0), (exposed1, wait1) = split_grad_wait([fast, slow])
    assert wait0 == pytest.approx(0.020) and exposed0 == pytest.approx(0.010)
    assert wait1 == 0.0 and exposed1 == pytest.approx(0.010)
    # never more wait than the rank spent after its last gradient
    (_, w), _ = split_grad_wait([{"step": 0.1, "grad_wait": 0.005}, {"step": 0.2, "grad_wait": 0.0}])
    assert w == 0.005


def _run(tmp: Path) -> tuple[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MEMRT="1", MEMRT_REPORT_DIR=str(tmp / "report"), XDG_CACHE_HOME=str(tmp / "c"))
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS),
            "--out", str(tmp / "out")]
    proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr, [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_summary_step_split_matches_the_job_own_clock(tmp_path):
    text, jobs = _run(tmp_path)
    lines = text.splitlines()
    assert SUMMARY_HEADER in lines and STEP_HEADER in lines, text[-3000:]
    memory_rows = lines[lines.index(SUMMARY_HEADER) + 1:lines.index(SUMMARY_HEADER) + 3]
    assert all("memrt pg" in row for row in memory_rows), memory_rows  # memrt's process group carries DDP
    at = lines.index(STEP_HEADER)
    for rank, row in enumerate(lines[at + 1:at + 3]):
        cells = row.split()[1:]
        assert int(cells[0]) == rank and int(cells[1]) == STEPS, row
        step, data, fwd, bwd, exposed, wait, optim, other = (float(c) / 1e3 for c in cells[2:10])
        ends = jobs[rank]["ends"]
        gaps = [b - a for a, b in zip(ends, ends[1:])][SKIP - 1:]  # the summary's steps after the first SKIP
        mean = sum(gaps) / len(gaps)
        assert step == pytest.approx(mean, rel=0.05), (row, mean)
        assert data + fwd + bwd + exposed + wait + optim + other == pytest.approx(step, rel=0.01, abs=4e-4), row
        assert other >= jobs[rank]["other_s"] * 0.95, row  # the script's own wait after each step
        assert data >= jobs[rank]["data_s"] * 0.9, row  # loading a batch
        assert fwd > 0 and bwd > 0 and optim > 0 and exposed >= 0, row
        slow = jobs[1]["slow_s"]
        if rank == 0:  # waits at its backward's end for rank 1's slower forward
            assert wait >= 0.7 * slow, row
        else:
            assert wait <= 0.3 * slow and fwd >= slow, row


def test_docs_sample_has_the_headers_a_run_prints():
    text = DOCS.read_text()
    assert SUMMARY_HEADER in text and STEP_HEADER in text
    sample = text.split(STEP_HEADER, 1)[1].splitlines()[1]
    assert re.fullmatch(r"memrt: +\d+ +\d+( +\d+\.\d){8} +\d+\.\d\d", sample), sample
