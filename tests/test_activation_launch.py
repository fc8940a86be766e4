"""MEMRT=1 on an unchanged DDP script (tests/scripts/ddp_train.py, no memrt import) under real launchers.

Few launches, many checks each (launches are the expensive part):
- MEMRT unset: the reference parameters; no memrt output, no report.
- torchrun, MEMRT=1, DataLoader workers: one banner, memory planned, comm hook, report files and summary,
  parameters equal to the reference, nothing of memrt in the workers.
- mpiexec, a different MEMRT_BUDGET per rank: different plans, parameters equal to the reference.
- mpiexec, MEMRT_BUDGET=lots: exit 2, the error once, no rank left waiting.
- memrt failing inside the DDP hook on one rank: one warning, the job finishes with the reference result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrt.launcher import free_port
from memrt.testing import venv_bin

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
STEPS = 5
"""Enough for a plan that certification re-plans (its first measured step over the budget) to be measured too."""
BANNER = "memrt 0.1.0 on |"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} hung for {timeout}s:\n{exc.stdout}\n{exc.stderr}")


def _torchrun(*args: str) -> list[str]:
    return [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS), *args]


def _load(path: Path) -> dict:
    import torch

    return torch.load(path)


def _assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs from the run without memrt"


def _reports(cwd: Path) -> list[dict]:
    runs = list((cwd / "memrt-report").iterdir())
    assert len(runs) == 1, f"one run id shared by all ranks, got {runs}"
    files = sorted(runs[0].glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"]
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Parameters after STEPS steps of the stock run (MEMRT unset; mpiexec starts fewer processes than torchrun)."""
    cwd = tmp_path_factory.mktemp("stock")
    mpiexec = venv_bin("mpiexec")
    args = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", "params.pt"]
    # Without memrt an MPI launch has no torchrun variables: give them per rank, as torchrun would.
    argv = ([mpiexec, "-n", "1", "-env", "RANK", "0", *args, ":", "-n", "1", "-env", "RANK", "1", *args]
            if mpiexec else _torchrun("--out", "params.pt"))
    extra = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if mpiexec else {}
    out = _run(argv, _env(**extra), cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memrt" not in out.stdout + out.stderr.replace(str(SCRIPT), "")
    assert not (cwd / "memrt-report").exists()
    return _load(cwd / "params.pt")


def test_torchrun_memrt_on(reference, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    out = _run(_torchrun("--out", "params.pt", "--workers", "1", "--probe-dir", str(probe)), _env(MEMRT="1"), tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count(BANNER) == 1, text[-4000:]
    banner = text[text.index(BANNER):].splitlines()[0]
    assert "launcher torchrun" in banner and "2 ranks = 1 node x 2" in banner
    assert "continuing without memrt" not in text, text[-4000:]
    _assert_same(_load(tmp_path / "params.pt"), reference)
    reports = _reports(tmp_path)
    for rank, rep in enumerate(reports):
        act = rep["meta"]["activation"]
        assert act["rank"] == rank and act["world_size"] == 2 and act["launcher"] == "torchrun"
        assert act["config"]["MEMRT"] == {"value": True, "source": "environment"}
        (model,) = act["models"]
        assert model["kind"] == "ddp" and model["memory"].startswith("planned"), model
        assert model["comm_hook"].startswith("memrt.comm"), model
        assert model["grads_via"] in ("memrt hook", "memrt pg"), model
        assert act["failures"] == []
    assert "memrt summary" in text and "2/2 ranks reported" in text
    workers = [json.loads(p.read_text()) for p in probe.glob("worker-*.json")]
    assert len(workers) == 2, "each rank's DataLoader worker writes one probe file"
    for w in workers:
        assert w["import_hooks"] == [], w
        assert not any(m.startswith(("memrt.activation.hooks", "memrt.memory", "memrt.comm")) for m in w["modules"]), w


def _calibrate() -> tuple[int, int]:
    """(smallest feasible, keep-all) peak bytes of the script's model in a one-rank DDP, from memrt's planner."""
    import importlib.util

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import memrt

    spec = importlib.util.spec_from_file_location("ddp_train_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = mod.TinyGPT()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        x, y = mod.Tokens(4)[0:4]

        def step():
            loss = F.cross_entropy(ddp(x).reshape(-1, mod.VOCAB), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()
        plan = memrt.plan(memrt.profile(model, step), None, offload="none")
        return plan.min_feasible_bytes, plan.keep_all_peak_bytes
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
def test_mpiexec_per_rank_budgets(reference, tmp_path):
    low, high = _calibrate()
    tight = int(low + 0.5 * (high - low))  # between memrt's smallest feasible budget and keep-everything
    loose = 4 * high
    py = sys.executable
    args = [str(SCRIPT), "--steps", str(STEPS), "--out", "params.pt"]
    argv = [venv_bin("mpiexec"), "-n", "1", "-env", "MEMRT_BUDGET", str(tight), py, *args,
            ":", "-n", "1", "-env", "MEMRT_BUDGET", str(loose), py, *args]
    # Recompute-only plans (MEMRT_OFFLOAD=none): the tight rank must recompute, the loose one keeps all.
    out = _run(argv, _env(MEMRT="1", MEMRT_OFFLOAD="none"), tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count(BANNER) == 1 and "launcher mpich" in text
    assert "continuing without memrt" not in text, text[-4000:]
    _assert_same(_load(tmp_path / "params.pt"), reference)
    plans = [rep["meta"]["activation"]["plans"] for rep in _reports(tmp_path)]
    assert all(plans), "each rank reports its plan"
    budgets = [p[-1]["budget_bytes"] for p in plans]
    assert budgets == [tight, loose]
    actions = [{u["action"] for u in p[-1]["units"]} - {"keep"} for p in plans]
    assert actions[0] == {"recompute"}, f"rank 0's tight budget must recompute some unit: {plans[0][-1]}"
    assert actions[1] == set(), f"rank 1's loose budget keeps everything: {plans[1][-1]}"
    measured = plans[0][-1]["measured_peak_bytes"]
    assert measured is not None, f"rank 0's last plan was never measured: {plans[0]}"
    assert measured <= tight


@pytest.mark.mpi
def test_bad_budget_exits_2_without_hanging(tmp_path):
    argv = [venv_bin("mpiexec"), "-n", "2", sys.executable, str(SCRIPT), "--out", "params.pt"]
    t0 = time.monotonic()
    out = _run(argv, _env(MEMRT="1", MEMRT_BUDGET="lots"), tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    # every rank that has the bad value says so, once, naming itself (mpiexec may stop a rank before it prints)
    lines = [l for l in out.stderr.splitlines() if l.startswith("memrt: error: MEMRT_BUDGET='lots' is not valid")]
    ranks = [l.rsplit("(rank ", 1)[-1].rstrip(")") for l in lines]
    assert 1 <= len(lines) == len(set(ranks)) <= 2 and set(ranks) <= {"0", "1"}, out.stderr
    assert "a share such as 60%" in out.stderr
    assert time.monotonic() - t0 < 100
    assert not (tmp_path / "params.pt").exists()


_INJECT = """
import os
if os.environ.get("RANK") == "1":
    import memrt.activation.wiring as wiring

    def _broken(*args, **kwargs):
        raise RuntimeError("injected failure inside memrt's DDP hook")

    wiring._plan_memory = _broken
"""


@pytest.mark.parametrize("process_group", ["1", "0"])
def test_memrt_failing_inside_the_hook_lets_the_job_finish(reference, tmp_path, process_group):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_INJECT)
    port = str(free_port())
    procs = []
    for rank in range(2):  # torchrun's environment, without its agent
        env = _env(MEMRT="1", MEMRT_PROCESS_GROUP=process_group, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=str(inject))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", "params.pt"],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [0, 0], text[-4000:]
    warnings = [line for line in text.splitlines() if "continuing without memrt" in line]
    assert len(warnings) == 1 and "rank 1" in warnings[0] and "injected failure" in warnings[0], text[-3000:]
    _assert_same(_load(tmp_path / "params.pt"), reference)
    reports = _reports(tmp_path)
    models = [rep["meta"]["activation"]["models"][0] for rep in reports]
    assert models[0]["memory"].startswith("planned") and models[1]["memory"] != models[0]["memory"]
    if process_group == "1":  # memrt's group carries DDP on both ranks whatever rank 1's plan did; no hook anywhere
        assert models[0]["comm_hook"] == "memrt.comm process group (no hook needed)", models
        assert not any(m["comm_hook"].startswith("memrt.comm (") for m in models), models
        assert [m["grads_via"] for m in models] == ["memrt pg", "memrt pg"], models
    else:
        assert "not on every rank" in models[0]["comm_hook"], "rank 1 stepped aside, so no rank may use the hook"
        assert [m["grads_via"] for m in models] == ["torch", "torch"], models
