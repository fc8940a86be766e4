"""The training patterns real jobs use, run unchanged (no memrt import) under MEMRT=1 and stock, final state compared.

Few launches, many checks each (a launch costs the ranks' ``import torch``): tests/scripts/pattern_jobs.py runs
several patterns one after another in the same 2 ranks (gloo, started as torchrun would by
``memrt.testing.launch.launch_ranks``) and saves each pattern's final state.

- stock (MEMRT=0), one launch: every pattern, the reference; the DCP resumes equal the uninterrupted runs.
- MEMRT=1 (memrt's process group, no budget), one launch: gradient accumulation with ``no_sync``,
  ``find_unused_parameters=True``, ``static_graph=True``, CPU autocast bf16, two DDP models with two optimizers,
  ``DDP(torch.compile(model))``, DCP save / fresh load / continue with DDP and with FSDP2: each bitwise equal to
  stock (stock is bitwise reproducible run to run for all of them: one thread, gloo's 2-rank sum, fixed data).
- MEMRT=1, ``torch.compile(DDP(model))``: its own launch (memrt's collectives run outside dynamo's tracing).
- ``torchrun --max-restarts 1``, MEMRT=1 with the disk tier: rank 1 dies with ``os._exit(1)`` once at step 3, the
  second attempt resumes from the DCP checkpoint, the final state equals the uninterrupted stock run; nothing of
  the dead attempt is left in /dev/shm, the offload folder or the report folder.
- PyTorch Lightning ``strategy="ddp"``, ``devices=2`` (Lightning starts rank 1 itself): stock vs MEMRT=1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrt.testing import venv_bin
from memrt.testing.launch import launch_ranks

SCRIPTS = Path(__file__).parent / "scripts"
JOBS = SCRIPTS / "pattern_jobs.py"
LIGHTNING = SCRIPTS / "pattern_lightning_ddp.py"
BANNER = "memrt 0.1.0 on |"
EAGER = ("plain", "no_sync", "unused", "static", "autocast", "gan", "compile_inner", "dcp_ddp", "fsdp2", "dcp_fsdp2")
"""Patterns of the MEMRT=1 launch; the stock launch also runs ``compile`` and ``ckpt``."""
DDP_MODELS = 10
"""DDP(...) calls of the EAGER patterns: one each, two in gan and in dcp_ddp (the run and the resumed model)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without memrt's or a launcher's variables (launch_ranks adds its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT") and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
        "NODE_RANK", "TORCHELASTIC_RESTART_COUNT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEMRT="0")
    env.update(extra)
    return env


def _launch(out: Path, patterns: tuple[str, ...], **env: str) -> tuple[list, str]:
    """Both ranks of tests/scripts/pattern_jobs.py on ``patterns``; (results, both ranks' output)."""
    t0 = time.perf_counter()
    results = launch_ranks(["python", str(JOBS), "--out", str(out), "--patterns", ",".join(patterns)],
                           ranks_per_node=[2], env=_env(**env), timeout_s=600, check=False)
    text = "".join(r.stdout + r.stderr for r in results)
    times = out / "times-0.json"
    print(f"pattern-launch MEMRT={env.get('MEMRT', '0')} {','.join(patterns)}: {time.perf_counter() - t0:.1f} s; "
          f"per pattern {times.read_text() if times.exists() else '-'}")
    return results, text


def _state(path: Path) -> dict:
    import torch

    return torch.load(path)


def _assert_same(mine: dict, ref: dict, what: str) -> None:
    import torch

    assert mine.keys() == ref.keys(), what
    for k in ref:
        assert torch.equal(mine[k], ref[k]), f"{what}: {k} differs (largest difference " \
                                             f"{(mine[k].float() - ref[k].float()).abs().max().item():.3g})"


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stock")
    results, text = _launch(out, EAGER + ("compile", "ckpt"))
    assert all(r.returncode == 0 for r in results), text[-4000:]
    assert "memrt" not in text.replace(str(SCRIPTS), ""), text[-2000:]
    return out


@pytest.fixture(scope="module")
def memrt_on(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("memrt")
    results, text = _launch(out, EAGER, MEMRT="1", MEMRT_REPORT_DIR=str(out / "report"))
    assert all(r.returncode == 0 for r in results), text[-6000:]
    return out, text


def test_stock_resume_from_dcp_equals_the_uninterrupted_run(stock):
    """The reference itself: DCP save at step 2, a fresh model and optimizer (another init) load and continue."""
    _assert_same(_state(stock / "dcp_ddp.pt"), _state(stock / "plain.pt"), "stock DDP resumed from DCP")
    _assert_same(_state(stock / "dcp_fsdp2.pt"), _state(stock / "fsdp2.pt"), "stock FSDP2 resumed from DCP")


def test_memrt_runs_every_pattern_through_its_process_group(memrt_on):
    """One banner; every DDP and FSDP2 model found, on memrt's process group, no failure; both ranks reported."""
    out, text = memrt_on
    assert text.count(BANNER) == 1, text[-4000:]
    banner = text[text.index(BANNER):].splitlines()[0]
    assert "launcher torchrun" in banner and "2 ranks = 1 node x 2" in banner and "backend memrt" in banner, banner
    assert "continuing without memrt" not in text, text[-4000:]
    assert "2/2 ranks reported" in text, text[-3000:]
    for rank in (0, 1):
        act = json.loads((out / "report" / f"rank{rank}.json").read_text())["meta"]["activation"]
        assert act["failures"] == [], act["failures"]
        ddp = [m for m in act["models"] if m["kind"] == "ddp"]
        assert len(ddp) == DDP_MODELS, [(m["kind"], m["module"]) for m in act["models"]]
        assert all(m["comm_hook"] == "memrt.comm process group (no hook needed)" for m in ddp), ddp
        fsdp = [m for m in act["models"] if m["kind"] != "ddp"]
        assert fsdp and all("memrt process group" in m["comm_hook"] for m in fsdp), fsdp
        assert all(m["grads_via"] == "memrt pg" for m in ddp + fsdp), act["models"]


@pytest.mark.parametrize("pattern", EAGER)
def test_pattern_under_memrt_equals_stock(stock, memrt_on, pattern):
    """The final state of each pattern under MEMRT=1, bitwise equal to the same pattern without memrt."""
    out, _ = memrt_on
    _assert_same(_state(out / f"{pattern}.pt"), _state(stock / f"{pattern}.pt"), f"{pattern} under MEMRT=1")


def test_memrt_resume_from_dcp_equals_the_uninterrupted_stock_run(stock, memrt_on):
    out, _ = memrt_on
    _assert_same(_state(out / "dcp_ddp.pt"), _state(stock / "plain.pt"), "DDP resumed from DCP under MEMRT=1")
    _assert_same(_state(out / "dcp_fsdp2.pt"), _state(stock / "fsdp2.pt"), "FSDP2 resumed from DCP under MEMRT=1")


def test_compiled_ddp_under_memrt_equals_stock(stock, tmp_path):
    """``torch.compile(DDP(model))`` (inductor, DDPOptimizer): MEMRT=1 trains and ends bitwise where stock does."""
    results, text = _launch(tmp_path, ("compile",), MEMRT="1", MEMRT_REPORT_DIR=str(tmp_path / "report"))
    assert all(r.returncode == 0 for r in results), text[-3000:]
    _assert_same(_state(tmp_path / "compile.pt"), _state(stock / "compile.pt"), "torch.compile(DDP) under MEMRT=1")


def _host() -> str:
    return socket.gethostname().replace("-", "_")


@pytest.mark.alone  # the plan weighs the disk tier's measured speed against recompute's: a loaded machine tips it
def test_torchrun_restart_resumes_and_leaves_nothing_behind(stock, tmp_path):
    """``torchrun --max-restarts 1``, MEMRT=1 with a plan on the disk tier: rank 1 dies (``os._exit(1)``, no clean-up)
    at step 3 of 6 in the first attempt; the second resumes from the step-2 DCP checkpoint and finishes with the
    uninterrupted stock run's state. Afterwards: no memrt slab of either attempt's ranks in /dev/shm, nothing left
    in the offload folder, the report folder holds the second attempt's two rank files only."""
    out, offload, report = tmp_path / "out", tmp_path / "offload", tmp_path / "report"
    marker = tmp_path / "killed"
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(JOBS),
            "--out", str(out), "--patterns", "ckpt", "--kill-at", "3", "--marker", str(marker)]
    env = _env(MEMRT="1", MEMRT_OFFLOAD="disk", MEMRT_BUDGET="7MiB", MEMRT_OFFLOAD_DIR=str(offload),
               MEMRT_REPORT_DIR=str(report))
    t0 = time.perf_counter()
    try:
        run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun --max-restarts 1 hung:\n{exc.stdout}\n{exc.stderr}")
    text = run.stdout + run.stderr
    print(f"pattern-launch torchrun --max-restarts 1, MEMRT=1: {time.perf_counter() - t0:.1f} s")
    assert run.returncode == 0, text[-5000:]
    assert marker.exists(), "rank 1 never died: the test did not test a restart"
    attempts = {p.name: json.loads(p.read_text()) for p in out.glob("attempt-*.json")}
    assert sorted(attempts) == [f"attempt-{a}-rank{r}.json" for a in (0, 1) for r in (0, 1)], attempts
    assert [attempts[f"attempt-1-rank{r}.json"]["start"] for r in (0, 1)] == [3, 3], attempts
    assert text.count(BANNER) == 2, text[-4000:]  # one per attempt
    _assert_same(_state(out / "ckpt.pt"), _state(stock / "ckpt.pt"), "restarted MEMRT=1 job")
    pids = {a["pid"] for a in attempts.values()}
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"memrt-shm-{_host()}-")
            and n.split("-")[3].isdigit() and int(n.split("-")[3]) in pids] if os.path.isdir("/dev/shm") else []
    assert left == [], left
    assert not offload.exists() or not any(offload.iterdir()), list(offload.rglob("*"))
    assert sorted(p.name for p in report.iterdir()) == ["rank0.json", "rank1.json"], list(report.iterdir())
    final = {attempts[f"attempt-1-rank{r}.json"]["pid"] for r in (0, 1)}
    for rank in (0, 1):
        rep = json.loads((report / f"rank{rank}.json").read_text())
        assert rep["pid"] in final, (rank, rep["pid"], final)
        act = rep["meta"]["activation"]
        assert act["failures"] == [], act["failures"]
        (plan, *_) = act["plans"]
        assert "offload_disk" in {u["action"] for u in plan["units"]}, "the disk tier was not in use"


def _lightning(folder: Path, **env: str) -> str:
    folder.mkdir()
    t0 = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, str(LIGHTNING), "--steps", "3", "--out", "params.pt"], cwd=folder,
                             env=_env(**env), capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"Lightning DDP job hung:\n{exc.stdout}\n{exc.stderr}")
    print(f"pattern-launch Lightning ddp, devices=2, MEMRT={env.get('MEMRT', '0')}: {time.perf_counter() - t0:.1f} s")
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-4000:]
    for rank in (0, 1):
        seen = json.loads((folder / f"params.pt.rank{rank}.json").read_text())
        assert seen["world"] == 2, seen
    return text


def test_lightning_ddp_two_devices_under_memrt_equals_stock(tmp_path):
    """Lightning ``strategy="ddp"``, ``accelerator="cpu", devices=2``: Lightning starts rank 1 itself. MEMRT=1: one
    banner for 2 ranks, the LightningModule planned and carried by memrt's process group on both ranks, both
    ranks reported, parameters bitwise equal to the stock run."""
    pytest.importorskip("pytorch_lightning")
    stock_text = _lightning(tmp_path / "stock")
    assert "memrt" not in stock_text.replace(str(SCRIPTS), ""), stock_text[-2000:]
    text = _lightning(tmp_path / "memrt", MEMRT="1")
    assert text.count(BANNER) == 1, text[-4000:]
    banner = text[text.index(BANNER):].splitlines()[0]
    assert "2 ranks = 1 node x 2" in banner and "backend memrt" in banner, banner
    assert "continuing without memrt" not in text and "2/2 ranks reported" in text, text[-4000:]
    (run,) = list((tmp_path / "memrt" / "memrt-report").iterdir())
    for rank in (0, 1):
        act = json.loads((run / f"rank{rank}.json").read_text())["meta"]["activation"]
        (model,) = act["models"]
        assert model["kind"] == "ddp" and model["module"] == "Net", model
        assert model["comm_hook"] == "memrt.comm process group (no hook needed)", model
        assert act["failures"] == [], act["failures"]
    _assert_same(_state(tmp_path / "memrt" / "params.pt"), _state(tmp_path / "stock" / "params.pt"),
                 "Lightning DDP under MEMRT=1")
