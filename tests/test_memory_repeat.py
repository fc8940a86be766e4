"""The same bits every run: every memrt action, and memrt.auto run again and again, equal stock bitwise.

Models: a long-skip (U-Net-like) MLP with dropout whose encoder outputs are summed into by several units,
a GPT with tied embeddings and dropout, a CNN with BatchNorm. Plans are chosen from measured timings,
which differ run to run; that may change speed, never numerics. So (1) every action on every unit
(keep, recompute, offload_disk, recompute+offload_disk, and an alternating mix) gives stock's
state_dict bitwise; (2) 10 runs of memrt.auto per model, each profiling and planning afresh at a budget
that forces more than keeping, default offload, all equal stock bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

import memrt
from memrt.memory.cache import PlanCache
from memrt.memory.planner import Plan, UnitPlan
from memrt.memory.units import find_units
from memrt.testing.models import GPT, ConvNet, GPTConfig, LongSkipMLP, gpt_batch, lm_loss

RUNS = 10
STEPS = 3
GPT_CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=64, vocab_size=64, dropout=0.1)


def _noise(shape):
    def batch(step):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(*shape, generator=g)
        return x, None

    return batch


MODELS = {
    "long_skip": lambda: (LongSkipMLP(width=128, depth=6), _noise((2048, 128)), lambda out, _: out.square().mean()),
    "tied_gpt": lambda: (GPT(GPT_CFG), lambda s: gpt_batch(GPT_CFG, 16, seed=s), lm_loss),
    "batchnorm_cnn": lambda: (ConvNet(channels=8, n_blocks=6), _noise((8, 3, 24, 24)),
                              lambda out, _: out.square().mean()),
}


def _train(model, batch, loss_fn, *, setup=None):
    if setup is not None:
        setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(99)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _differs(state, ref):
    assert state.keys() == ref.keys()
    return [k for k in ref if not torch.equal(state[k], ref[k])]


def _forced(actions):
    def setup(model):
        names = [n for n, _ in find_units(model)]
        pick = actions if isinstance(actions, list) else [actions] * len(names)
        memrt.apply(model, Plan(units=[UnitPlan(name=n, action=pick[i % len(pick)]) for i, n in enumerate(names)]))

    return setup


@pytest.mark.parametrize("name", list(MODELS))
def test_every_action_is_bitwise_stock(name, one_thread):
    torch.manual_seed(0)
    base, batch, loss_fn = MODELS[name]()
    ref = _train(copy.deepcopy(base), batch, loss_fn)
    plans = {a: a for a in ("keep", "recompute", "offload_disk", "recompute+offload_disk")}
    plans["mix"] = ["recompute+offload_disk", "offload_disk", "recompute", "keep"]
    for label, actions in plans.items():
        model = copy.deepcopy(base)
        state = _train(model, batch, loss_fn, setup=_forced(actions))
        memrt.disable(model)
        assert _differs(state, ref) == [], f"{name}: plan {label} differs from stock"


def _budget(base, batch, loss_fn) -> int:
    """A fifth of the way from memrt's smallest feasible budget to keeping everything: tight enough that
    plans go below checkpointing every unit (recompute + offload) and mix actions."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    with torch.random.fork_rng(devices=[]):
        plan = memrt.plan(memrt.profile(model, step), None, offload="auto")
    return int(plan.min_feasible_bytes + 0.2 * (plan.keep_all_peak_bytes - plan.min_feasible_bytes))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_ten_auto_runs_all_bitwise_stock(name, one_thread):
    torch.manual_seed(0)
    base, batch, loss_fn = MODELS[name]()
    ref = _train(copy.deepcopy(base), batch, loss_fn)
    budget = _budget(base, batch, loss_fn)
    seen_actions = set()
    for run in range(RUNS):
        model = copy.deepcopy(base)
        state = _train(model, batch, loss_fn, setup=lambda m: memrt.auto(m, budget, cache=PlanCache()))
        plan = memrt.plan_of(model)
        memrt.disable(model)
        assert plan is not None and any(u.action != "keep" for u in plan.units), f"{name} run {run}: {plan}"
        seen_actions.update(u.action for u in plan.units)
        assert _differs(state, ref) == [], f"{name}: run {run + 1} of {RUNS} differs from stock; plan:\n{plan}"
    assert len(seen_actions) >= 2, f"{name}: the budget forced no mix of actions: {seen_actions}"


@pytest.mark.slow
def test_plans_from_perturbed_timings_and_slow_io_are_bitwise_stock(one_thread, monkeypatch, tmp_path):
    """Timings decide the plan: plans made from randomly perturbed unit timings (many different plans) are
    all bitwise stock; and offload I/O that completes late and out of step (random delays on the I/O
    thread) changes nothing either."""
    import dataclasses
    import random
    import time

    from memrt.memory.offload import disk

    torch.manual_seed(0)
    base, batch, loss_fn = MODELS["long_skip"]()
    ref = _train(copy.deepcopy(base), batch, loss_fn)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    with torch.random.fork_rng(devices=[]):
        profile = memrt.profile(model, step)
    base_plan = memrt.plan(profile, None, offload="auto")
    budget = int(base_plan.min_feasible_bytes + 0.3 * (base_plan.keep_all_peak_bytes - base_plan.min_feasible_bytes))
    rnd = random.Random(7)  # private: the user's generators stay untouched
    original_write, original_read = disk.DiskTier._write_entry, disk.DiskTier._read

    def slow_write(self, entry):
        time.sleep(rnd.random() * 0.004)
        return original_write(self, entry)

    def slow_read(self, entry, dst):
        time.sleep(rnd.random() * 0.004)
        return original_read(self, entry, dst)

    monkeypatch.setattr(disk.DiskTier, "_write_entry", slow_write)
    monkeypatch.setattr(disk.DiskTier, "_read", slow_read)
    plans = set()
    for trial in range(6):
        units = [dataclasses.replace(u, forward_seconds=u.forward_seconds * rnd.uniform(0.05, 20.0))
                 for u in profile.units]
        plan = memrt.plan(dataclasses.replace(profile, units=units), budget, offload="auto")
        plans.add(tuple(u.action for u in plan.units))
        model = copy.deepcopy(base)
        state = _train(model, batch, loss_fn, setup=lambda m: memrt.apply(m, plan, offload_dir=str(tmp_path)))
        memrt.disable(model)
        assert _differs(state, ref) == [], f"trial {trial}: plan {[u.action for u in plan.units]} differs"
    assert len(plans) >= 2, f"the perturbed timings gave one plan only: {plans}"
