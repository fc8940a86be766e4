"""memrt never draws from, reseeds or advances a generator the user can see.

Generators: torch's CPU (and initialised CUDA) default generators, numpy's global state, Python's
``random``. Checked: unchanged across the offload bandwidth probe and the comm probe's local rates;
across planning (with an empty bandwidth cache, so the probe runs inside ``memrt.plan``); and, for a
model with dropout, equal after every step of ``memrt.auto`` (profiling, planning, certification,
planned steps) to what the same steps leave without memrt. A whole ``MEMRT=1`` torchrun of an unchanged
script (tests/scripts/rng_train.py) with an empty cache directory records the same generator states
after every step and the same final parameters as the run without memrt.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import memrt
from memrt.memory.cache import PlanCache
from memrt.launcher import free_port
from memrt.testing import venv_bin
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss
from memrt.testing.rng import changed_generators, rng_states

SCRIPT = Path(__file__).parent / "scripts" / "rng_train.py"
CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=32, vocab_size=64, dropout=0.1)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """XDG_CACHE_HOME pointed at a new folder: no cached bandwidths, as on a new machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_bandwidth_probe_leaves_generators_alone(tmp_path):
    from memrt.memory.offload import probe_bandwidths

    _seed_all(1)
    before = rng_states()
    probe_bandwidths("cpu", str(tmp_path), nbytes=1 << 20)
    assert changed_generators(before, rng_states()) == []


def test_comm_probe_local_rates_leave_generators_alone():
    from memrt.comm.probe import _local_rates

    _seed_all(2)
    before = rng_states()
    _local_rates(1 << 16)
    assert changed_generators(before, rng_states()) == []


def _profiled_gpt():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = gpt_batch(CFG, 8, seed=0)

    def step():
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()

    return model, step


def test_profile_step_moves_generators_as_the_stock_step_does():
    model, step = _profiled_gpt()
    _seed_all(3)
    step()  # stock
    after_stock = rng_states()
    model, step = _profiled_gpt()
    _seed_all(3)
    memrt.profile(model, step)  # every unit recomputed in backward
    assert changed_generators(after_stock, rng_states()) == []


def test_planning_with_an_empty_cache_leaves_generators_alone(empty_cache):
    model, step = _profiled_gpt()
    step()
    profile = memrt.profile(model, step)
    _seed_all(4)
    before = rng_states()
    plan = memrt.plan(profile, int(0.6 * memrt.plan(profile, None).keep_all_peak_bytes), offload="auto")
    assert any(empty_cache.rglob("*.json")), "the bandwidth probe should have run (and cached) inside plan()"
    assert any(u.action != "keep" for u in plan.units)
    assert changed_generators(before, rng_states()) == []


def _train_states(model, *, steps: int, budget=None):
    """Generator states after every step (the script also draws from numpy and random each step)."""
    if budget is not None:
        memrt.auto(model, budget, cache=PlanCache())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _seed_all(5)
    states = []
    for s in range(steps):
        x, y = gpt_batch(CFG, 8, seed=s)
        noise = np.random.rand()  # the user's own draws from the global generators, between steps
        random.random()
        opt.zero_grad()
        (lm_loss(model(x), y) * (1 + 0 * noise)).backward()
        opt.step()
        states.append(rng_states())
    return states, {k: v.clone() for k, v in model.state_dict().items()}


def test_auto_steps_leave_generators_as_stock_does(empty_cache):
    torch.manual_seed(0)
    base = GPT(CFG)
    ref_states, ref_params = _train_states(copy.deepcopy(base), steps=4)
    model = copy.deepcopy(base)
    # a budget that needs a plan: profile, plan (with the bandwidth probe: the cache is empty), certify
    states, params = _train_states(model, steps=4, budget=int(0.5 * _keep_all_bytes(base)))
    plan = memrt.plan_of(model)
    assert plan is not None and plan.measured_peak_bytes is not None
    assert any(u.action != "keep" for u in plan.units), plan
    for step, (a, b) in enumerate(zip(ref_states, states)):
        assert changed_generators(a, b) == [], f"after step {step + 1}"
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k


def _keep_all_bytes(base) -> int:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = gpt_batch(CFG, 8, seed=0)

    def step():
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()

    with torch.random.fork_rng(devices=[]):
        step()
        return memrt.plan(memrt.profile(model, step), None, offload="none").keep_all_peak_bytes


# -- a whole MEMRT=1 run of an unchanged script ------------------------------------------------------------

def _calibrate() -> int:
    """A budget halfway between memrt's smallest feasible and keep-everything, for the script's DDP model."""
    import importlib.util

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("rng_train_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = mod.Net()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            x = torch.randn(mod.BATCH, mod.WIDTH)

            def step():
                opt.zero_grad(set_to_none=True)
                ddp(x).square().mean().backward()
                opt.step()

            plan = memrt.plan(memrt.profile(model, step), None, offload="none")  # step 1, as in the run
        return int(plan.min_feasible_bytes + 0.5 * (plan.keep_all_peak_bytes - plan.min_feasible_bytes))
    finally:
        dist.destroy_process_group()


def _torchrun(tmp_path: Path, name: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / f"cache-{name}"), **env_extra)
    out = tmp_path / f"{name}.pt"
    argv = [venv_bin("torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), "--steps", "4", "--out", str(out)]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_memrt_on_unchanged_script_keeps_every_generator(tmp_path):
    budget = _calibrate()
    stock = _torchrun(tmp_path, "stock")
    run = _torchrun(tmp_path, "memrt", MEMRT="1", MEMRT_BUDGET=str(budget), MEMRT_REPORT_DIR=str(tmp_path / "r"))
    assert run["digests"] == stock["digests"], "generator states after some step differ from the stock run"
    for k, v in stock["params"].items():
        assert torch.equal(run["params"][k], v), k
    reports = list((tmp_path / "r").rglob("rank0.json"))
    assert reports, "MEMRT=1 wrote no report: memrt was not on"
    plans = json.loads(reports[0].read_text())["meta"]["activation"]["plans"]
    assert plans and any(u["action"] != "keep" for u in plans[-1]["units"]), plans
