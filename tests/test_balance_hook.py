"""The weighted comm hook and the balancer's bookkeeping in one process (a 1-rank gloo group)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


class _Bucket:
    def __init__(self, t):
        self._t = t

    def buffer(self):
        return self._t

    def index(self):
        return 0


def test_hook_weights_then_sums(one_rank_group):
    from memrt.balance import WeightedHookState, weighted_allreduce_hook

    st = WeightedHookState(weight=0.25, world_size=1)
    st.start_step(0.25, 0.0)
    out = weighted_allreduce_hook(st, _Bucket(torch.tensor([4.0, 8.0]))).wait()
    assert torch.equal(out, torch.tensor([1.0, 2.0]))
    assert st.buckets_this_step == 1 and st.compute_s is not None


def test_hook_composes_with_an_averaging_inner_hook(one_rank_group):
    from memrt.balance import WeightedHookState, weighted_allreduce_hook

    def averaging(state, bucket):  # what DDP's default and memrt.comm's hook do: x * (1/W), SUM
        buf = bucket.buffer().mul_(1.0 / state)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    st = WeightedHookState(weight=0.75, world_size=4, inner_hook=averaging, inner_state=4)
    out = weighted_allreduce_hook(st, _Bucket(torch.tensor([4.0]))).wait()
    assert out.item() == pytest.approx(3.0)  # 4 * (4 * 0.75) / 4
    st = WeightedHookState(weight=0.75, world_size=4, inner_hook=averaging, inner_state=1, inner_averages=False)
    assert weighted_allreduce_hook(st, _Bucket(torch.tensor([4.0]))).wait().item() == pytest.approx(3.0)


def test_balancer_step_sets_weight_and_measures(one_rank_group):
    from memrt.balance import BalanceConfig, SpeedBalancer

    bal = SpeedBalancer(10, config=BalanceConfig(rebalance_every=2, warmup_steps=1))
    assert bal.shares.per_rank == (10,)
    with bal.step(10):
        assert bal.hook_state.weight == 1.0
    with bal.step(10):
        pass
    assert bal.steps == 2 and len(bal.decisions) == 1  # one decision after rebalance_every steps
    assert bal.decisions[0].shares == (10,) and not bal.decisions[0].changed
    with pytest.raises(ValueError, match="max_samples"):
        SpeedBalancer(10, max_samples=0)
    with pytest.raises(ValueError, match="every rank needs at least one sample"):
        SpeedBalancer(10, shares=(10, 0))


def test_balancer_starts_within_the_memory_bound(one_rank_group):
    from memrt.balance import SpeedBalancer

    with pytest.raises(ValueError, match="lower global_batch or raise the budgets"):
        SpeedBalancer(10, max_samples=6)
    assert SpeedBalancer(6, max_samples=6).shares.per_rank == (6,)


def test_attach_refuses_a_second_hook_with_advice(one_rank_group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memrt.balance import SpeedBalancer

    ddp = DDP(torch.nn.Linear(3, 2))
    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="already has a comm hook"):
        SpeedBalancer(4).attach(ddp, comm="torch")
