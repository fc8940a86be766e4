"""Share decisions, the balanced sampler and the throughput meter (no processes)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrt.balance import (BalanceConfig, BalancedBatchSampler, Capability, Shares, ThroughputMeter, decide_shares,
                           max_samples_for_budget, predicted_step_seconds, uniform_shares)
from memrt.balance.shares import _water_fill


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=1, max_size=9), st.integers(0, 500),
       st.data())
def test_decide_shares_invariants(speeds, extra, data):
    w = len(speeds)
    B = w + extra
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(1, B)), min_size=w, max_size=w))
    if sum(B if c is None else c for c in caps) < B:
        with pytest.raises(ValueError, match="does not fit"):
            decide_shares(B, speeds, caps)
        return
    s = decide_shares(B, speeds, caps)
    assert sum(s.per_rank) == B and len(s.per_rank) == w
    assert all(b >= 1 for b in s.per_rank)
    assert all(c is None or b <= c for b, c in zip(s.per_rank, caps))
    assert decide_shares(B, list(speeds), list(caps)) == s  # deterministic
    # rounding moves each rank by less than one sample from the real-valued water-filling optimum
    ideal = _water_fill(float(B), speeds, 1.0, [float(B if c is None else c) for c in caps])
    assert all(abs(b - x) < 1.0 + 1e-6 for b, x in zip(s.per_rank, ideal))


def test_decide_shares_proportional_and_bounded():
    assert decide_shares(8, [7.0, 1.0]).per_rank == (7, 1)
    assert decide_shares(23, [7.0, 1.0]).per_rank == (20, 3)
    assert decide_shares(64, [3.0, 1.0], [40, None]).per_rank == (40, 24)  # memory bound wins over speed
    assert decide_shares(10, [1000.0, 1.0, 1.0]).per_rank == (8, 1, 1)  # nobody drops to zero
    assert uniform_shares(15, 2).per_rank == (8, 7)


def test_decide_shares_errors_say_what_to_do():
    with pytest.raises(ValueError, match="global_batch=1 < world size 2"):
        decide_shares(1, [1.0, 1.0])
    with pytest.raises(ValueError, match=r"speeds\[1\]"):
        decide_shares(4, [1.0, 0.0])
    with pytest.raises(ValueError, match="lower global_batch or raise the budgets"):
        decide_shares(10, [1.0, 1.0], [3, 3])
    with pytest.raises(ValueError, match="at least one sample"):
        Shares(per_rank=(4, 0), global_batch=4)
    with pytest.raises(ValueError, match="rebalance_every"):
        BalanceConfig(rebalance_every=1, warmup_steps=1)


def test_weights_sum_to_one_and_step_time():
    s = Shares(per_rank=(20, 3), global_batch=23)
    assert sum(s.weight(r) for r in range(2)) == pytest.approx(1.0)
    assert s.offset(1) == 20
    assert predicted_step_seconds(s, [10.0, 1.0]) == pytest.approx(3.0)


class _Source:
    def __init__(self, shares, rank):
        self.shares, self.rank = shares, rank


def test_sampler_covers_every_global_batch_once_even_when_shares_change():
    n, B = 100, 12
    sources = [_Source(Shares(per_rank=(6, 6), global_batch=B), r) for r in range(2)]
    samplers = [BalancedBatchSampler(n, src, seed=3) for src in sources]
    iters = [iter(s) for s in samplers]
    assert len(samplers[0]) == len(samplers[1]) == n // B
    seen = []
    for step in range(n // B):
        if step == 3:  # a step boundary: every rank switches at once
            for src in sources:
                src.shares = Shares(per_rank=(11, 1), global_batch=B)
        parts = [next(it) for it in iters]
        expected = (6, 6) if step < 3 else (11, 1)
        assert tuple(len(p) for p in parts) == expected
        batch = parts[0] + parts[1]
        assert len(set(batch)) == B
        seen += batch
    assert all(next(it, None) is None for it in iters)  # every rank ends at the same step
    assert len(set(seen)) == len(seen) == (n // B) * B


def test_sampler_global_batches_match_distributed_sampler():
    """Same global batches (as sets) as stock DDP's DistributedSampler with B/W per rank."""
    from torch.utils.data import DistributedSampler

    n, B, W = 96, 16, 2
    mine = [list(BalancedBatchSampler(n, Shares(per_rank=(13, 3), global_batch=B), rank=r, seed=5)) for r in range(W)]
    stock = [list(DistributedSampler(list(range(n)), num_replicas=W, rank=r, seed=5, drop_last=True))
             for r in range(W)]
    per = B // W
    for k in range(n // B):
        ours = set(mine[0][k]) | set(mine[1][k])
        theirs = set().union(*(stock[r][k * per:(k + 1) * per] for r in range(W)))
        assert ours == theirs


def test_meter_ignores_warmup_and_windows():
    m = ThroughputMeter(window_steps=2, warmup_steps=1)
    assert m.samples_per_s() is None
    m.add(10, 100.0)  # warm-up: ignored
    m.add(10, 1.0)
    m.add(30, 1.0)
    m.add(10, 1.0)  # pushes the 10/1.0 out of the 2-step window
    assert m.samples_per_s() == pytest.approx(20.0)
    m.reset()
    assert m.samples_per_s() is None and m.measured_steps == 0


def test_capability_and_memory_bound():
    assert max_samples_for_budget(1000, 200, 100) == 8
    with pytest.raises(ValueError, match="MEMRT_BUDGET"):
        max_samples_for_budget(250, 200, 100)
    with pytest.raises(ValueError, match="samples_per_s"):
        Capability(samples_per_s=0.0)


def test_memory_bound_from_a_memrt_plan():
    from memrt.balance import max_samples_from_plan
    from memrt.memory.planner import Plan

    plan = Plan(budget_bytes=1100, predicted_peak_bytes=500, margin_bytes=100)
    assert max_samples_from_plan(plan, 10) == 20  # 50 bytes/sample (all of the peak scales), 1000 usable
    plan.measured_peak_bytes = 1000
    assert max_samples_from_plan(plan, 10) == 10
    assert max_samples_from_plan(Plan(budget_bytes=None, predicted_peak_bytes=500), 10) is None


def test_estimate_sample_bytes_is_linear_in_batch():
    import torch
    from torch import nn
    import torch.nn.functional as F

    from memrt.balance import estimate_sample_bytes

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def make(n):
        return torch.randn(n, 32), torch.randint(0, 4, (n,))

    per = estimate_sample_bytes(model, make, F.cross_entropy, batch_sizes=(2, 6))
    # saved per sample: input 32 + relu output/mask 64 (+ linear inputs 64) float32 and log-softmax 4: order 1 KB
    assert 4 * 32 <= per <= 4 * 32 * 16
