"""MEMRT=1 with no budget still records the memory timeline: one measured step per input shape.

- In process: memrt.auto(model) with no budget measures one step (the second) and records it; the
  gradients are stock's bitwise; nothing is profiled.
- Under ``MEMRT=1 torchrun`` (2 ranks, DDP, no budget, the unchanged example script): ``memrt report``
  shows a memory row per rank with a peak, fixed and activation bytes.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import memrt
import memrt.memory.auto as auto_mod
from memrt.memory.certify import Certifier
from memrt.memory.cache import PlanCache
from memrt.memory.meter import watch_optimizers
from memrt.profiling.recorder import get_recorder
from memrt.testing import venv_bin
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

REPO = Path(__file__).resolve().parent.parent
CFG = GPTConfig(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64, dropout=0.1)


def _train(model, steps):
    watch_optimizers()
    torch.manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for s in range(steps):
        opt.zero_grad()
        x, y = gpt_batch(CFG, 8, seed=s)
        lm_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def test_no_budget_measures_one_step_and_keeps_numerics():
    torch.manual_seed(0)
    base = GPT(CFG)
    ref = _train(copy.deepcopy(base), 4)
    model = copy.deepcopy(base)
    get_recorder().clear()
    memrt.auto(model, None, offload="none", cache=PlanCache())
    starts = []
    begin = Certifier.start

    def counting(self, inputs):
        starts.append(self.steps.step)
        return begin(self, inputs)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Certifier, "start", counting)
            mp.setattr(auto_mod.ProfileSession, "begin", lambda *a, **k: pytest.fail("profiled without a budget"))
            grads = _train(model, 4)
        for a, b in zip(grads, ref):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert starts == [2], starts
        kinds = [(e.kind, e.label) for e in get_recorder().memory]
        assert ("step_begin", "certify") in kinds and ("step_end", "certify") in kinds, kinds
        plan = memrt.plan_of(model)
        assert plan.budget_bytes is None and plan.measured_peak_bytes and plan.measured_peak_bytes > 0
    finally:
        memrt.disable(model)
        get_recorder().clear()


@pytest.mark.slow
def test_memrt_1_without_budget_reports_memory_per_rank(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MEMRT="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2",
            str(REPO / "examples" / "activation_unchanged_ddp.py"), "--steps", "4"]
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (run,) = list((tmp_path / "memrt-report").iterdir())
    rep = subprocess.run([venv_bin("memrt"), "report", str(run)], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-3000:]
    text = rep.stdout
    section = text[text.index("== memory"):].split("\n\n")[0]
    assert "(no memory events)" not in section, section
    for rank in (0, 1):
        size = r"([\d.]+ \w+)"
        row = re.search(rf"^\s+{rank}\s+(\d+)\s+{size}\s+{size}\s+{size}\s+-\s+-\s+cpu", section, re.M)
        assert row, f"no memory row for rank {rank}:\n{section}"
        assert int(row.group(1)) >= 1 and not row.group(2).startswith("0 ")
