"""Input shapes that vary (dynamic padding), forwards outside training steps, API misuse.

- Shape buckets: a transformers GPT-2 fed dynamically padded batches (a new length every step) under
  memrt.auto: gradients bitwise equal to stock at every step, the tracker's peak <= budget at every step,
  each bucket profiled at most once, the plan cache bounded, one warning.
- A validation forward with grad enabled (no backward), ``torch.no_grad`` and ``inference_mode``
  forwards between steps are not steps: they neither profile nor certify, and the plan and its measured
  peak are those of the same job without them.
- API calls on objects memrt did not plan: a TypeError naming what was expected.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import memrt
import memrt.memory.auto as auto_mod
from memrt.memory.buckets import bucket_dim, bucket_shapes, scale_profile, shape_scale
from memrt.memory.cache import CacheEntry, PlanCache
from memrt.memory.meter import known_tensors, watch_optimizers
from memrt.testing.zoo import padded_batch
from memrt.memory.planner import Plan
from memrt.memory.profile import Constraint, Profile, UnitProfile
from memrt.profiling.cpu_tracker import CpuMemoryTracker
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss


# -- rules --------------------------------------------------------------------------------------------
def test_bucket_bounds_and_scale():
    assert [bucket_dim(n) for n in (0, 1, 2, 3, 4, 5, 96, 128, 129, 257, 512)] == [0, 1, 2, 4, 4, 8, 128, 128,
                                                                                    256, 512, 512]
    shapes = [((8, 300), "int64", "cpu"), ((8, 300), "int64", "cpu")]
    bound = bucket_shapes(shapes)
    assert bound == [((8, 512), "int64", "cpu")] * 2
    assert shape_scale(shapes, bound) == pytest.approx(512 / 300)
    assert shape_scale(bound, bound) == 1.0


def test_scale_profile_scales_activations_not_fixed_bytes():
    u = UnitProfile(index=0, name="h.0", saved_bytes=100, input_bytes=10, saved_not_input_bytes=90,
                    forward_keep_transient_bytes=120, forward_recompute_transient_bytes=30, has_backward=True,
                    forward_start_bytes=1000 + 50, backward_start_bytes=1000 + 200, backward_transient_bytes=40,
                    backward_recompute_transient_bytes=60)
    p = Profile(units=[u], start_live_bytes=1000, end_live_bytes=1600,
                constraints=[Constraint(prefix=1, bytes=1000 + 300, label="forward"),
                             Constraint(prefix=0, bytes=2500, label="optimizer", shifted=False)])
    s = scale_profile(p, 2.0)
    v = s.units[0]
    assert (v.saved_bytes, v.input_bytes, v.saved_not_input_bytes) == (200, 20, 180)
    assert v.forward_keep_transient_bytes == 240
    assert (v.forward_start_bytes, v.backward_start_bytes) == (1100, 1400)  # fixed part kept, the rest doubled
    assert [c.bytes for c in s.constraints] == [1600, 2500]  # the optimizer phase does not grow with shapes
    assert (s.start_live_bytes, s.end_live_bytes) == (1000, 1600)
    assert p.units[0].saved_bytes == 100  # the original is unchanged
    assert scale_profile(p, 1.0) is p


def test_plan_cache_is_bounded_lru():
    cache = PlanCache(max_entries=3)
    entry = lambda: CacheEntry(plan=Plan(), profile=Profile())  # noqa: E731
    for k in "abc":
        cache.put(k, entry())
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", entry())
    assert len(cache) == 3 and cache.get("b") is None and cache.get("a") is not None
    with pytest.raises(ValueError, match="max_entries"):
        PlanCache(max_entries=0)


# -- dynamic padding on transformers' GPT-2 -------------------------------------------------------------
def _run(model, lengths, *, budget=None, cache=None, offload="none"):
    """AdamW steps over ``lengths``; returns (gradients per step, tracker peak per step)."""
    watch_optimizers()
    torch.manual_seed(0)
    if budget is not None:
        memrt.auto(model, budget, offload=offload, cache=cache)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads, peaks = [], []
    for s, n in enumerate(lengths):
        opt.zero_grad(set_to_none=True)
        b = padded_batch(s, n, batch=4, vocab=1024)
        tr = CpuMemoryTracker().start(known_tensors(model, list(b.values())), scan_gc=False)
        loss = model(**b).loss
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        del loss
        tr.stop()
        peaks.append(tr.peak_bytes)
    return grads, peaks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dynamic_padding_gpt2_plans_per_bucket(caplog):
    pytest.importorskip("transformers", reason='the model zoo needs transformers: pip install "memrt[test]"')
    from memrt.testing import zoo

    case = zoo.build("gpt2", "tiny")
    base = case.model
    g = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(20, 129, (16,), generator=g)]
    assert len({bucket_dim(n) for n in lengths}) == 3 and len(set(lengths)) > 10
    ref, stock_peaks = _run(copy.deepcopy(base), lengths)
    ckpt = copy.deepcopy(base)
    case.checkpoint(ckpt, 1)  # transformers' own checkpointing of every layer
    _, ckpt_peaks = _run(ckpt, [max(lengths)] * 2)  # its peak at the longest batch, optimizer state present
    budget = (max(stock_peaks) + max(ckpt_peaks)) // 2  # midway at the longest batch: keep-all does not fit
    assert max(stock_peaks) > budget

    profiled: list[str] = []
    begin = auto_mod.ProfileSession.begin

    def counting_begin(self, *args, **kwargs):
        profiled.append(self.profile.signature)
        return begin(self, *args, **kwargs)

    cache = PlanCache()
    model = copy.deepcopy(base)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="memrt"):
        mp.setattr(auto_mod.ProfileSession, "begin", counting_begin)
        grads, peaks = _run(model, lengths, budget=budget, cache=cache)
    try:
        for s, (a, b) in enumerate(zip(grads, ref)):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"step {s}: gradients differ"
        over = [(s, n, p) for s, (n, p) in enumerate(zip(lengths, peaks)) if p > budget]
        assert not over, f"steps over the budget {budget}: {over}"
        buckets = [int(sig.split(",")[1].split(")")[0]) for sig in profiled]
        buckets = [bucket_dim(n) for n in buckets]
        assert len(buckets) == len(set(buckets)) <= 3, f"profiled more than once per bucket: {profiled}"
        # bounded: one entry per bucket plus the exact shapes seen before the shapes varied
        assert len(cache) <= 3 + 2
        notices = [r for r in caplog.records if "input shapes vary" in r.getMessage()]
        assert len(notices) == 1, [r.getMessage() for r in caplog.records]
        assert memrt.plan_of(model) is not None
        plans = [e.plan for e in cache._mem.values()]
        assert all(p.measured_peak_bytes is None or p.measured_peak_bytes <= budget for p in plans)
        # the longest bucket needs recomputation; it is planned for its bound (128), not the length profiled
        top = [p for p in plans if "(4, 128)" in p.signature]
        assert top and any(u.action != "keep" for u in top[0].units), [str(p) for p in plans]
    finally:
        memrt.disable(model)


# -- forwards outside a training step -----------------------------------------------------------------
GPT_CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=32, vocab_size=64, dropout=0.1)


def _gpt_job(model, steps, *, budget, evals: bool, cache):
    """Train ``steps`` steps; with ``evals`` a validation loss with grad enabled (no backward), a no_grad
    and an inference_mode forward follow every optimizer step, and one comes before the first step."""
    watch_optimizers()
    torch.manual_seed(1)
    memrt.auto(model, budget, offload="none", cache=cache)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    val_x, val_y = gpt_batch(GPT_CFG, 24, seed=99)  # another batch size than training's

    def evaluate():
        lm_loss(model(val_x), val_y).item()  # grad enabled, never backwarded
        with torch.no_grad():
            model(val_x)
        with torch.inference_mode():
            model(val_x)

    if evals:
        with torch.random.fork_rng(devices=[]):
            evaluate()
    grads = []
    for s in range(steps):
        opt.zero_grad()
        x, y = gpt_batch(GPT_CFG, 16, seed=s)
        lm_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if evals:
            with torch.random.fork_rng(devices=[]):  # dropout in eval draws: keep training's stream
                evaluate()
    return grads


def test_eval_forwards_are_not_training_steps():
    torch.manual_seed(0)
    base = GPT(GPT_CFG)
    # the eager peak of a training step, as memrt's tracker counts it
    probe = copy.deepcopy(base)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-2)
    for s in range(2):
        opt.zero_grad()
        x, y = gpt_batch(GPT_CFG, 16, seed=s)
        tr = CpuMemoryTracker().start(known_tensors(probe, [x, y]), scan_gc=False)
        lm_loss(probe(x), y).backward()
        opt.step()
        tr.stop()
    budget = int(0.6 * tr.peak_bytes)

    plain, with_evals = copy.deepcopy(base), copy.deepcopy(base)
    ref = _gpt_job(plain, 4, budget=budget, evals=False, cache=PlanCache())
    ref_plan = memrt.plan_of(plain)
    memrt.disable(plain)

    profiled: list[str] = []
    begin = auto_mod.ProfileSession.begin

    def counting_begin(self, *args, **kwargs):
        profiled.append(self.profile.signature)
        return begin(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auto_mod.ProfileSession, "begin", counting_begin)
        grads = _gpt_job(with_evals, 4, budget=budget, evals=True, cache=PlanCache())
    try:
        plan = memrt.plan_of(with_evals)
        for s, (a, b) in enumerate(zip(grads, ref)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {s}: gradients differ"
        # the validation forward (batch 24) was started as a profile before the first step and dropped;
        # the training shape was profiled once; shapes never "varied" (no bucket plans)
        assert [p.split(":")[0] for p in profiled] == ["(24, 32)", "(16, 32)"], profiled
        assert not auto_mod._STATES[with_evals].steps.varying
        assert [u.action for u in plan.units] == [u.action for u in ref_plan.units]
        # certified on a training step: the same measured peak as the job without evaluation
        assert plan.measured_peak_bytes == ref_plan.measured_peak_bytes <= budget
    finally:
        memrt.disable(with_evals)


# -- API misuse -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["auto", "plan_of", "disable", "apply", "profile", "plan"])
def test_api_on_objects_memrt_does_not_plan(call):
    fn = getattr(memrt, call)
    args = {"auto": ("x",), "plan_of": ("x",), "disable": ("x",), "apply": ("x", None),
            "profile": ("x", lambda: None), "plan": ("x", 10**9)}[call]
    expected = "memrt.Profile" if call == "plan" else "torch.nn.Module"
    with pytest.raises(TypeError, match=rf"memrt\.{call} expects .*{expected}.*got str"):
        fn(*args)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="memrt.Plan"):
        memrt.apply(model, {"units": []})
    assert memrt.plan_of(model) is None  # a module memrt never saw has no plan
    assert memrt.disable(model) is model


def test_eval_forward_of_the_training_shape_before_training_does_not_stop_planning():
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    watch_optimizers()
    memrt.auto(model, 10**9, offload="none", cache=PlanCache())
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = gpt_batch(GPT_CFG, 16, seed=0)
        for _ in range(2):  # validation loss at the training shape, grad enabled, never backwarded
            lm_loss(model(x), y).item()
        assert memrt.plan_of(model) is None
        for s in range(3):
            opt.zero_grad()
            x, y = gpt_batch(GPT_CFG, 16, seed=s)
            lm_loss(model(x), y).backward()
            opt.step()
        model(x).sum().backward()  # closes the measured step
        plan = memrt.plan_of(model)
        assert plan is not None and plan.measured_peak_bytes is not None
    finally:
        memrt.disable(model)
