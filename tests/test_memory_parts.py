"""The parts of memrt.auto one by one: step tracking, the plan in force, compiled trials, certification's
arithmetic, and the public error policy (fast, in-process)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import memrt
from memrt.errors import BudgetError
from memrt.memory.apply import applied_plan
from memrt.memory.auto import on_plan_error
from memrt.memory.cache import CacheEntry, PlanCache
from memrt.memory.certify import held_back, missed_by, overshoot_margin
from memrt.memory.compiled import GRAPH_BUDGET_TRIES, CompiledCpuMeter
from memrt.memory.inforce import PlanInForce
from memrt.memory.meter import CudaMeter, Meter
from memrt.memory.planner import Plan
from memrt.memory.profile import Profile
from memrt.memory.steps import EVAL_SHAPES, StepTracker
from memrt.memory.trials import FLOOR_STEPS, CompiledTrials
from memrt.testing.models import KwargsMLP


def _x(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape)


# -- StepTracker ----------------------------------------------------------------------------------------
def test_steps_switch_to_buckets_only_when_a_new_shape_trains():
    st = StepTracker()
    sig = st.enter((_x(16, 32),), {})
    assert sig == "(16, 32):float32:cpu" and not st.varying
    st.note_training()
    assert st.trained_shapes == [((16, 32), "float32", "cpu")]
    # another shape: buckets, provisionally
    assert st.enter((_x(24, 32),), {}) == "(32, 32):float32:cpu"
    assert st.varying and st.provisional
    st.not_a_step(profiled=True)  # it got no backward: not varying after all, remembered as evaluation shape
    assert not st.varying and not st.provisional and "(24, 32):float32:cpu" in st.no_backward
    assert st.enter((_x(24, 32),), {}) is None and st.watching == "(24, 32):float32:cpu"
    assert st.close_watch() and st.watching is None
    # backward_seen was False: still an evaluation shape
    assert "(24, 32):float32:cpu" in st.no_backward


def test_steps_confirm_varying_shapes_with_one_warning(caplog):
    st = StepTracker()
    st.enter((_x(16, 32),), {})
    st.note_training()
    st.enter((_x(24, 32),), {})
    with caplog.at_level(logging.WARNING, logger="memrt"):
        st.note_training()
    assert st.varying and not st.provisional
    assert [r.name for r in caplog.records] == ["memrt.memory.auto"] and "vary" in caplog.text


def test_steps_evaluation_shapes_are_bounded():
    st = StepTracker()
    for n in range(EVAL_SHAPES + 3):
        st.enter((_x(n + 1, 4),), {})
        st.not_a_step()
    assert len(st.no_backward) == EVAL_SHAPES
    assert next(iter(st.no_backward)).startswith("(4, 4)")  # the oldest three were forgotten


def test_steps_see_a_backward_of_the_output():
    st = StepTracker()
    w = torch.ones(3, requires_grad=True)
    out = (w * 2).sum()
    st.watch_output(out)
    assert st.backward_seen is False
    out.backward()
    assert st.backward_seen is True and st.was_training() and st.backward_seen is False
    st.watch_output(torch.zeros(2))  # nothing to watch: counted as training
    assert st.backward_seen is None and st.was_training()
    st.watch_output((w * 3).sum())  # never backpropagated
    assert not st.was_training()


# -- PlanInForce ----------------------------------------------------------------------------------------
class _Handle:
    def __init__(self) -> None:
        self.plans: list = []

    def set_plan(self, plan) -> None:
        self.plans.append(plan)


def test_plan_in_force_caches_applies_and_falls_back():
    handle = _Handle()
    inforce = PlanInForce(PlanCache(), handle)
    assert inforce.switch("k1", "sig1") is None and inforce.key == "k1" and handle.plans == []
    p1 = Plan(budget_bytes=100)
    inforce.use(p1, Profile(), tries=2, scale=1.5)
    assert inforce.plan is p1 and p1.tries == 2 and p1.shape_scale == 1.5 and p1.signature == "sig1"
    assert handle.plans == [p1]
    shapes = [((4, 4), "float32", "cpu")]
    inforce.accept("k1", inforce.entry, shapes)
    assert inforce.entry.measured_shapes == shapes
    inforce.last_key = "k1"
    inforce.switch("k2", "sig2")
    inforce.put(CacheEntry(plan=Plan(budget_bytes=100), profile=Profile()))
    assert inforce.cache.get("k2") is inforce.entry
    inforce.back_to_last()  # a forward that was not a step: the last training step's plan again
    assert inforce.key == "k1" and inforce.plan is p1 and handle.plans[-1] is p1
    inforce.drop()
    assert inforce.key is None and inforce.entry is None and handle.plans[-1] is None
    entry = inforce.cache.get("k1")
    inforce.keep("k1", entry, shapes)
    assert inforce.entry is entry and handle.plans[-1] is p1


# -- CompiledTrials -------------------------------------------------------------------------------------
def _inst(**kw):
    base = dict(traced_step=True, units_in_graph=False, compiled_step=True)
    base.update(kw)
    return SimpleNamespace(**base)


def test_trials_partition_only_whole_compiled_models_without_random_draws():
    trials = CompiledTrials(_inst(), budget=1000, device=torch.device("cpu"), sharded=False)
    quiet, drawing = Profile(draws_random=False), Profile(draws_random=True)
    assert trials.partitioned(quiet, "k") and not trials.partitioned(drawing, "k")
    trials.unpartitioned.add("k")
    assert not trials.partitioned(quiet, "k") and trials.partitioned(quiet, "other")
    assert not CompiledTrials(_inst(), budget=None, device=torch.device("cpu"), sharded=False).partitioned(quiet, "k")
    assert not CompiledTrials(_inst(), budget=1000, device=torch.device("cpu"), sharded=True).partitioned(quiet, "k")
    assert not CompiledTrials(_inst(units_in_graph=True), budget=1000, device=torch.device("cpu"),
                              sharded=False).shadow_profiled()


def test_trials_partitioner_retries_then_plans_by_units():
    trials = CompiledTrials(_inst(), budget=1000, device=torch.device("cpu"), sharded=False)
    missed = Plan(budget_bytes=1000, compiled_budget=0.5)
    trials.partitioner_tries["k"] = GRAPH_BUDGET_TRIES
    assert trials.partitioner_retry("k", missed, Profile(), 1200, 200, 300) is None
    assert "k" in trials.unpartitioned


def test_trials_floor_is_measured_over_floor_steps():
    trials = CompiledTrials(_inst(), budget=1000, device=torch.device("cpu"), sharded=False)
    p, profile = trials.unprofiled_floor([("a", torch.nn.Linear(2, 2)), ("b", torch.nn.Linear(2, 2))], "s", "sig")
    assert p.floor_trial and profile.unprofiled and [u.name for u in profile.units] == ["a", "b"]
    assert [trials.floor_missed() for _ in range(FLOOR_STEPS)] == [True] * (FLOOR_STEPS - 1) + [False]
    assert CompiledTrials(_inst(compiled_step=False), budget=1000, device=torch.device("cpu"),
                          sharded=False).floor_plan(profile) is None


# -- certification's arithmetic -------------------------------------------------------------------------
def test_overshoot_margin_holds_back_the_model_error():
    p = Plan(budget_bytes=1000, predicted_peak_bytes=900, margin_bytes=50, min_feasible_bytes=600)
    # measured 1100: 100 over; the model missed by 200 (> margin + over = 150)
    assert missed_by(p, 1100, 100) == 200
    assert overshoot_margin(p, 1100, 100) == 200 + 4096
    # the margin leaves no feasible plan, the room above the least peak (400) still holds the miss: the room
    assert held_back(p, 1000, 1100, 100) == 400
    # plenty of room: the margin itself
    assert held_back(p, 10**6, 1100, 100) == 200 + 4096


# -- meters ---------------------------------------------------------------------------------------------
def test_meters_declare_validity_and_resident_peak():
    assert Meter().valid and Meter().resident_peak is None
    assert issubclass(CompiledCpuMeter, Meter) and CompiledCpuMeter().resident_peak is None
    assert CudaMeter.resident_peak is Meter.resident_peak


# -- the public error policy ----------------------------------------------------------------------------
def _step(model, x):
    model(x).sum().backward()


def test_on_plan_error_disables_and_calls_back_instead_of_raising():
    torch.manual_seed(0)
    model = KwargsMLP(width=16, n_blocks=3)
    x = torch.randn(64, 16)
    assert not on_plan_error(model, lambda exc: None)  # not under memrt.auto
    memrt.auto(model, 1000, offload="none", cache=PlanCache())
    errors: list[Exception] = []
    assert on_plan_error(model, errors.append)
    _step(model, x)  # profiled
    _step(model, x)  # planning finds nothing under 1000 bytes: the callback, not an exception
    assert len(errors) == 1 and isinstance(errors[0], BudgetError)
    assert memrt.plan_of(model) is None
    _step(model, x)  # runs as without memrt
    assert len(errors) == 1


def test_on_plan_error_none_restores_raising():
    torch.manual_seed(0)
    model = KwargsMLP(width=16, n_blocks=3)
    x = torch.randn(64, 16)
    memrt.auto(model, 1000, offload="none", cache=PlanCache())
    try:
        assert on_plan_error(model, lambda exc: None) and on_plan_error(model, None)
        _step(model, x)
        with pytest.raises(BudgetError):
            _step(model, x)
    finally:
        memrt.disable(model)


def test_applied_plan_is_the_plan_apply_put_in_force():
    model = KwargsMLP(width=8, n_blocks=2)
    assert applied_plan(model) is None
    p = Plan(budget_bytes=None)
    memrt.apply(model, p)
    try:
        assert applied_plan(model) is p and memrt.plan_of(model) is p
    finally:
        memrt.disable(model)
    assert applied_plan(model) is None
