"""The parts both ways of balancing share, one at a time, in one process (no launch, no process group unless
said): the speed window, the store exchange, the decision, the application of shares, the step timer, the comm
hook's observer and the share sampler behind the explicit API."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from memrt.testing.balance import DictStore
import torch
from torch.utils.data import DistributedSampler

from memrt.balance.capability import ThroughputMeter
from memrt.balance.decision import AutoBalanceConfig, ShareDecider, propose
from memrt.balance.exchange import StoreExchange
from memrt.balance.feed import LoaderFeed
from memrt.balance.hook import WeightedHookState, weighted_allreduce_hook
from memrt.balance.loader import ShareSampler, balanced_sampler_for
from memrt.balance.sampler import BalancedBatchSampler
from memrt.balance.shares import Shares
from memrt.balance.timing import StepTimer




# ------------------------------------------------------------------------------------------- speed window
def test_meter_median_skip_and_forward_window():
    m = ThroughputMeter(window_steps=3, warmup_steps=1)
    m.add(10, 100.0)  # warm-up
    for seconds in (1.0, 0.5, 100.0):  # an evaluation in the third step: the median ignores it
        m.add(10, seconds, 0.25)
    assert m.samples_per_s() == pytest.approx(10.0) and m.samples_per_s(forward=True) == pytest.approx(40.0)
    m.skip(2)  # after a share change: two steps left out, the window kept
    m.add(10, 0.01)
    m.add(10, 0.01)
    assert m.measured_steps == 3 and m.samples_per_s() == pytest.approx(10.0)
    assert not ThroughputMeter(warmup_steps=1).admit()


# ----------------------------------------------------------------------------------------------- exchange
def test_store_exchange_rounds_in_rank_order_and_cleans_up():
    store = DictStore()
    store.set("b/1/1", json.dumps({"x": 2}))  # rank 1 posted first
    ex = StoreExchange(store, rank=0, world=2, prefix="b")
    assert ex.gather({"x": 1}) == [{"x": 1}, {"x": 2}]
    store.set("b/2/1", json.dumps({"x": 4}))
    assert ex.gather({"x": 3}) == [{"x": 3}, {"x": 4}]
    assert "b/1/0" not in store.d and "b/2/0" in store.d  # this rank's previous round is deleted
    with pytest.raises(RuntimeError, match="missing"):
        ex.gather({"x": 5})  # rank 1 never posts round 3


def test_one_rank_group_exchanges_through_the_default_store(tmp_path):
    import torch.distributed as dist

    from memrt.balance import gather_capabilities
    from memrt.balance.exchange import exchange_for_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", world_size=1, rank=0)
    try:
        assert gather_capabilities(12.5, None) == [(12.5, None)]
        assert gather_capabilities(3.0, 7) == [(3.0, 7)]  # a new exchange per call: no stale round
        a, b = exchange_for_group(), exchange_for_group()
        assert a.gather({"v": 1}) == [{"v": 1}] and b.gather({"v": 2}) == [{"v": 2}]
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- decision
def test_propose_gain_and_memory_bound():
    p = propose(Shares(per_rank=(8, 8), global_batch=16), [3.0, 1.0], [None, None])
    assert p.shares.per_rank == (12, 4) and p.gain == pytest.approx(1 - 4 / 8) and not p.over
    assert propose(Shares(per_rank=(8, 8), global_batch=16), [1.0, 1.0], [6, None]).over


def _figures(speeds, reduction="mean", loaders=((0, 3, 3, True, 16),)):
    return [{"sps": s, "sps_forward": s, "between": True, "bound": None, "reduction": reduction, "root": "",
             "accum": 1, "loaders": [list(x) for x in loaders]} for s in speeds]


class _InForce:
    def __init__(self, shares=None):
        self.shares = shares

    def shares_now(self):
        return self.shares


def test_decider_reasons():
    d = ShareDecider(AutoBalanceConfig(), 2)
    assert d.decide(_figures([None, 1.0]), step=8, loaders=[_InForce()], skipped={})["reason"] == \
        "speeds not measured yet"
    out = d.decide(_figures([3.0, 1.0], loaders=()), step=8, loaders=[], skipped={"an iterable dataset": 1})
    assert "no DataLoader" in out["reason"] and "iterable" in out["reason"] and out["warn"]
    assert not d.decide(_figures([3.0, 1.0], loaders=()), step=9, loaders=[], skipped={})["warn"]  # once
    first = d.decide(_figures([3.0, 1.0]), step=10, loaders=[_InForce()], skipped={})
    assert first["confirm"] and not first["changed"] and d.confirmed
    second = d.decide(_figures([3.0, 1.0]), step=20, loaders=[_InForce()], skipped={})
    assert second["changed"] and second["loaders"] == [{"loader": 0, "from": [0, 3], "shares": [12, 4],
                                                         "global_batch": 16}]
    on = ShareDecider(AutoBalanceConfig(mode="on"), 2)
    assert on.decide(_figures([3.0, 1.0], reduction="sum"), step=8, loaders=[_InForce()], skipped={})["changed"]


# ------------------------------------------------------------------------------------ application of shares
def _share(rank, world=2, n=64, b=8):
    return ShareSampler(_source(rank, world, n, b))


def _source(rank, world, n, b):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=1)
    return balanced_sampler_for(s, None, b, False).source


def test_feed_marks_steps_and_applies_decisions():
    feed = LoaderFeed(2)
    share = _share(0)
    feed.add(share)
    assert feed.mark_step() == 1 and feed.factor == 1.0  # nothing consumed yet: steps/s
    feed.apply({"reduction": "mean", "loaders": [{"loader": 0, "from": [0, 1], "shares": [12, 4],
                                                  "global_batch": 16}]})
    it = iter(share)
    next(it), next(it), next(it)  # prefetched
    share.note_consumed()
    assert feed.mark_step() == 8 and feed.factor == 1.0 and share.trained
    share.note_consumed()
    assert feed.mark_step() == 12 and feed.factor == pytest.approx(12 * 2 / 16)
    assert feed.lag_steps() == 1 and feed.figures() == [[0, 3, 2, True, 16]]
    feed.apply({"reduction": "mean", "loaders": [{"loader": 0, "from": [0, 3], "shares": [8, 8],
                                                  "global_batch": 16}]})
    assert share.shares_at((0, 3)) == (None, "mean")  # the uniform split is the stock split


# ----------------------------------------------------------------------------------------------- timing
def test_step_timer_windows_on_the_host():
    meter = ThroughputMeter(window_steps=4, warmup_steps=0)
    ends = []
    timer = StepTimer(meter, on_step_end=lambda: ends.append(1) or False)
    timer.between_all_reduces = True
    module = torch.nn.Linear(1, 1)
    timer.forward_pre_hook(module, ())
    time.sleep(0.02)
    timer.step_samples = 4
    assert timer.bucket_ready() and timer.in_step and not timer.bucket_ready()
    timer.hook_returned(0.0)
    timer.reduction_done(SimpleNamespace(value=lambda: None))
    time.sleep(0.01)  # the optimizer step: in the next window (between all-reduces), not in the forward one
    timer.forward_pre_hook(module, ())  # closes step 1
    assert ends == [1] and meter.measured_steps == 1
    fwd = meter.samples_per_s(forward=True)
    assert 4 / 0.2 < fwd < 4 / 0.02 * 1.01
    time.sleep(0.02)
    timer.bucket_ready()
    timer.forward_pre_hook(module, ())
    between, forward = meter.samples_per_s(), meter.samples_per_s(forward=True)
    assert meter.measured_steps == 2 and between < forward  # the window since the reduction holds more work


# ------------------------------------------------------------------------------------ hook with an observer
class _Observer:
    def __init__(self, factor):
        self.factor, self.returned = factor, []

    def bucket_ready(self):
        return self.factor

    def hook_returned(self, seconds, future):
        self.returned.append(seconds)
        return future


def _echo(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_hook_applies_the_observers_factor_and_skips_a_factor_of_one():
    bucket = SimpleNamespace(buffer=lambda t=torch.tensor([2.0, 4.0]): t)
    obs = _Observer(1.5)
    st = WeightedHookState(inner_hook=_echo, world_size=2, weight=0.1, observer=obs)
    assert torch.equal(weighted_allreduce_hook(st, bucket).wait(), torch.tensor([3.0, 6.0]))
    assert len(obs.returned) == 1
    untouched = SimpleNamespace(buffer=lambda t=torch.tensor([2.0]): SimpleNamespace(
        is_cuda=False, mul_=lambda f: pytest.fail("a factor of 1 does no arithmetic")))
    weighted_allreduce_hook(WeightedHookState(inner_hook=lambda s, b: "f", observer=_Observer(1.0)), untouched)


def test_controller_hook_state_and_public_timing_flag():
    from memrt.balance.auto import Controller

    ctl = Controller(store=DictStore(), rank=0, world=2, config=AutoBalanceConfig())
    st = ctl.hook_state(inner_hook=_echo, inner_state=None, is_timer=False)
    assert st.observer is not None and st.world_size == 2 and not ctl.timing_attached
    assert st.observer.bucket_ready() == 1.0 and ctl.steps == 0  # a model that is not timed counts no steps


# ---------------------------------------------------------------------------------------------- sampler
def test_balanced_batch_sampler_is_the_share_sampler():
    shares = Shares(per_rank=(12, 11), global_batch=23)  # uneven even split: still re-split by the shares
    parts = [list(BalancedBatchSampler(100, shares, rank=r, seed=2)) for r in range(2)]
    assert isinstance(BalancedBatchSampler(100, shares, rank=0), ShareSampler)
    assert [len(b) for b in parts[0]] == [12] * 4 and [len(b) for b in parts[1]] == [11] * 4
    order = torch.randperm(100, generator=torch.Generator().manual_seed(2)).tolist()
    assert [a + b for a, b in zip(*parts)] == [order[k * 23:(k + 1) * 23] for k in range(4)]
