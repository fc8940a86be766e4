"""MEMRT=1 balances an unchanged DDP + DistributedSampler job (benchmarks/balance_job.py, no memrt import).

One fixture runs every launch (torchrun, 2 ranks, rank 1 slowed by a sleep per sample in forward set by
the job's own BALANCE_JOB_DELAY; no root needed); each test checks one promise:
- the shares follow the measured speeds, and the decision is in rank 0's stderr and in both rank reports;
  a rank slowed between steps (its dataset sleeps per sample, no DataLoader workers) is measured slow too,
  and a job's own collective in forward (SyncBatchNorm's kind) does not make the fast rank look slow;
- every step's sample set (the union over ranks) and the steps per epoch equal stock's, across epochs
  (set_epoch), partial last batches, DataLoader workers, and drop_last;
- final parameters allclose to stock (rtol 1e-4) and the final loss within 1%;
- equal ranks (both sleep the same per sample) and MEMRT_BALANCE=off: the stock split, parameters bitwise
  equal to stock (the sleep changes no arithmetic); the job's set-up frozen for Python's garbage collector on
  every rank (also with DataLoader workers), and not in the ``off`` run, which also sets MEMRT_GC_FREEZE=off;
- an iterable dataset: a warning, stock batches.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from memrt.testing import venv_bin

JOB = Path(__file__).resolve().parent.parent / "benchmarks" / "balance_job.py"
SLOW = {"BALANCE_JOB_DELAY": "1=0.0006"}
# Equal ranks on a shared machine: both sleep the same time per sample, which CPU contention does not stretch
EQUAL = {"BALANCE_JOB_DELAY": "0=0.0006,1=0.0006"}
BASE = ["--samples", "602", "--batch", "16", "--steps", "45", "--warmup", "0", "--width", "256"]

pytestmark = pytest.mark.slow


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRT", "BALANCE_JOB"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _launch(tmp: Path, name: str, env: dict[str, str], *args: str) -> dict:
    out = tmp / name
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(JOB), *BASE, *args, "--out", str(out)]
    proc = subprocess.run(argv, env=_env(env), cwd=tmp, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    import torch

    return {"ranks": ranks, "params": torch.load(f"{out}.params.pt"), "stderr": proc.stderr, "cwd": tmp}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balance")
    on = {"MEMRT": "1", "MEMRT_REPORT_DIR": str(tmp / "reports")}
    return {
        "stock": _launch(tmp, "stock", SLOW),
        "memrt": _launch(tmp, "memrt", {**SLOW, **on}, "--workers", "2"),
        "off": _launch(tmp, "off", {**SLOW, **on, "MEMRT_BALANCE": "off", "MEMRT_GC_FREEZE": "off",
                                    "MEMRT_REPORT_DIR": str(tmp / "r-off")}),
        "slow_loading": _launch(tmp, "slow_loading", {**on, "BALANCE_JOB_LOAD_DELAY": "1=0.0006",
                                                      "MEMRT_REPORT_DIR": str(tmp / "r-load")}),
        "sync_in_forward": _launch(tmp, "sync_in_forward", {**SLOW, **on, "MEMRT_REPORT_DIR": str(tmp / "r-sync")},
                                   "--sync-in-forward"),
        "equal": _launch(tmp, "equal", {**on, **EQUAL, "MEMRT_REPORT_DIR": str(tmp / "r-equal")}),
        "iterable": _launch(tmp, "iterable", {**SLOW, **on, "MEMRT_REPORT_DIR": str(tmp / "r-it")}, "--iterable"),
        "stock_dl": _launch(tmp, "stock_dl", SLOW, "--drop-last", "--sampler-drop-last"),
        "memrt_dl": _launch(tmp, "memrt_dl", {**SLOW, **on, "MEMRT_REPORT_DIR": str(tmp / "r-dl")},
                            "--drop-last", "--sampler-drop-last"),
    }


def _unions(run: dict) -> list[list[int]]:
    a, b = run["ranks"]
    return [sorted(x + y) for x, y in zip(a["steps"], b["steps"])]


def _reports(run: dict, folder: str, entry: str = "balance") -> list[dict]:
    paths = sorted((run["cwd"] / folder).glob("rank*.json"))
    return [json.loads(p.read_text())["meta"]["activation"][entry] for p in paths]


def _allclose(a, b, rtol=1e-4, atol=1e-6) -> bool:
    import torch

    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def test_shares_follow_the_measured_speeds(runs):
    from memrt.balance.shares import decide_shares

    r0, r1 = runs["memrt"]["ranks"]
    assert len(set(r0["sizes"])) > 1, "the slow rank's job was never balanced"
    assert r0["sizes"][0] == r1["sizes"][0] == 16  # uniform until measured
    assert r0["sizes"][-5] > 16 > r1["sizes"][-5]  # then rank 1 (slow) takes fewer samples
    reports = _reports(runs["memrt"], "reports")
    assert len(reports) == 2 and reports[0]["decisions"] == reports[1]["decisions"]
    changed = [d for d in reports[0]["decisions"] if d["changed"]]
    assert changed and changed[0]["reduction"] == "mean"
    d = changed[0]
    # shares in proportion to the speeds measured at the shares in force
    assert tuple(d["shares"]) == decide_shares(32, d["samples_per_s"], d["max_samples"]).per_rank
    assert d["samples_per_s"][0] > d["samples_per_s"][1] and d["predicted_gain"] > 0.05
    assert reports[0]["shares"] == changed[-1]["shares"]
    assert "memrt: balance: step" in runs["memrt"]["stderr"] and "memrt: balance (auto): shares" in runs["memrt"]["stderr"]


def test_slow_loading_between_steps_is_measured(runs):
    """The time between steps (here a rank's DataLoader drawing its batch) is on the synchronous step's
    critical path: the rank whose dataset sleeps per sample gets fewer samples."""
    r0, r1 = runs["slow_loading"]["ranks"]
    assert r0["sizes"][-5] > 16 > r1["sizes"][-5], (r0["sizes"], r1["sizes"])
    d = next(d for d in _reports(runs["slow_loading"], "r-load")[0]["decisions"] if d["changed"])
    assert d["samples_per_s"][0] > 1.2 * d["samples_per_s"][1], d


def test_wait_in_a_collective_of_the_job_is_not_work(runs):
    """Each forward ends in an all-reduce where the fast rank waits for the slow one: that wait is left out of
    the fast rank's time, so the slow rank still gets fewer samples."""
    r0, r1 = runs["sync_in_forward"]["ranks"]
    assert r0["sizes"][-5] > 16 > r1["sizes"][-5], (r0["sizes"], r1["sizes"])


@pytest.mark.parametrize("memrt,stock", [("memrt", "stock"), ("memrt_dl", "stock_dl")])
def test_same_sample_sets_per_step_and_steps_per_epoch(runs, memrt, stock):
    assert _unions(runs[memrt]) == _unions(runs[stock])
    for m, s in zip(runs[memrt]["ranks"], runs[stock]["ranks"]):
        assert m["epoch_steps"] == s["epoch_steps"] and m["loader_len"] == s["loader_len"]
    assert len(runs[memrt]["ranks"][0]["epoch_steps"]) >= 3  # crossed epochs: set_epoch reshuffled as stock
    if memrt == "memrt":  # partial last batches (301 per rank = 18 x 16 + 13) were split too
        parts = [(a, b) for a, b in zip(runs[memrt]["ranks"][0]["sizes"], runs[memrt]["ranks"][1]["sizes"])
                 if a + b == 26]
        assert parts and parts[-1][0] > 13 > parts[-1][1]


@pytest.mark.parametrize("memrt,stock", [("memrt", "stock"), ("memrt_dl", "stock_dl")])
def test_parameters_and_loss_match_stock(runs, memrt, stock):
    assert _allclose(runs[memrt]["params"], runs[stock]["params"])
    lm, ls = runs[memrt]["ranks"][0]["final_loss"], runs[stock]["ranks"][0]["final_loss"]
    assert abs(lm - ls) <= 0.01 * abs(ls)


def test_parameters_are_the_weighted_mean_of_the_ranks_parts(runs):
    """The same batches trained in one process, each step's gradient formed from the ranks' parts as the run
    split them (each part's mean-loss gradient weighted by its share, as the balanced hook does): stock's job
    and MEMRT=1's land on theirs bitwise (two ranks: a sum of two is the same either order); the parts'
    gradients averaged unweighted (DDP's average under uneven parts) do not."""
    import torch

    from benchmarks._balance_jobs import split_reference

    args = dict(zip(BASE[::2], BASE[1::2]))
    shape = {"samples": int(args["--samples"]), "width": int(args["--width"]),
             "features": 64, "depth": 3, "classes": 10, "lr": 0.05}  # the job's defaults
    stock = [r["steps"] for r in runs["stock"]["ranks"]]
    assert all(torch.equal(a, b) for a, b in zip(runs["stock"]["params"], split_reference(stock, shape)))
    steps = [r["steps"] for r in runs["memrt"]["ranks"]]
    assert all(torch.equal(a, b) for a, b in zip(runs["memrt"]["params"], split_reference(steps, shape)))
    unweighted = split_reference(steps, shape, weighted=False)
    assert not _allclose(runs["memrt"]["params"], unweighted, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["equal", "off"])
def test_equal_ranks_and_off_keep_the_stock_split_bitwise(runs, name):
    import torch

    for m, s in zip(runs[name]["ranks"], runs["stock"]["ranks"]):
        assert m["steps"] == s["steps"]
    assert all(torch.equal(a, b) for a, b in zip(runs[name]["params"], runs["stock"]["params"]))
    folder = {"equal": "r-equal", "off": "r-off"}[name]
    reports = _reports(runs[name], folder)
    frozen = _reports(runs[name], folder, "gc_frozen")
    if name == "off":
        assert reports == [None, None] and "memrt: balance" not in runs[name]["stderr"]
        assert [f["skipped"] for f in frozen] == ["MEMRT_GC_FREEZE=off"] * 2, frozen
    else:
        assert all(not d["changed"] for d in reports[0]["decisions"]) and reports[0]["decisions"]
        assert "stock split kept" in runs[name]["stderr"]
        _assert_set_up_frozen(frozen)


def _assert_set_up_frozen(frozen: list) -> None:
    """The job's set-up frozen for Python's garbage collector on every rank (torch alone makes ~10^5 objects)."""
    assert len(frozen) == 2 and all(f["objects"] > 50_000 and "skipped" not in f for f in frozen), frozen


def test_set_up_frozen_with_dataloader_workers(runs):
    """The balanced run's DataLoader forks two workers per rank after the freeze; training and the report as
    in every other run."""
    _assert_set_up_frozen(_reports(runs["memrt"], "reports", "gc_frozen"))


def test_iterable_dataset_stays_unbalanced_with_a_warning(runs):
    r0, r1 = runs["iterable"]["ranks"]
    assert r0["sizes"] == r1["sizes"] and max(r0["sizes"]) == 16
    err = runs["iterable"]["stderr"]
    assert "left unbalanced" in err and "iterable dataset" in err
