"""Share sampler, loss-reduction check and the balancer's decision rule, in one process (no launch)."""

from __future__ import annotations

import pytest

from memrt.testing.balance import DictStore
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DistributedSampler

from memrt.balance.auto import AutoBalanceConfig, Controller
from memrt.balance.loader import ShareSampler, _AccelerateSource, _DistributedSource, unbalanced_reason
from memrt.balance.reduction import classify_loss


def _stock(n, world, b, shuffle, sampler_drop, loader_drop, epoch=0):
    out = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=5, drop_last=sampler_drop)
        s.set_epoch(epoch)
        out.append([list(x) for x in BatchSampler(s, b, loader_drop)])
    return out


def _share(n, world, b, shuffle, sampler_drop, loader_drop, rank, epoch=0):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=sampler_drop)
    share = ShareSampler(_DistributedSource(s, b, loader_drop))
    share.set_epoch(epoch)
    return share


@pytest.mark.parametrize("n,world,b", [(50, 2, 4), (53, 3, 5), (7, 4, 3), (64, 4, 16)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("sampler_drop,loader_drop", [(False, False), (True, False), (False, True), (True, True)])
def test_stock_shares_yield_exactly_the_stock_batches(n, world, b, shuffle, sampler_drop, loader_drop):
    for epoch in (0, 3):
        stock = _stock(n, world, b, shuffle, sampler_drop, loader_drop, epoch)
        for r in range(world):
            share = _share(n, world, b, shuffle, sampler_drop, loader_drop, r, epoch)
            assert len(share) == len(stock[r])
            got = list(share)
            assert got == stock[r]
            assert all(f == 1.0 for f, _ in share._pending)  # noqa: SLF001 - stock split: no gradient factor


@pytest.mark.parametrize("sampler_drop,loader_drop", [(False, False), (True, True)])
def test_balanced_shares_keep_every_step_sample_set(sampler_drop, loader_drop):
    n, world, b = 61, 3, 4
    stock = _stock(n, world, b, True, sampler_drop, loader_drop)
    shares = [_share(n, world, b, True, sampler_drop, loader_drop, r) for r in range(world)]
    for s in shares:
        s.schedule((0, 2), (7, 3, 2), "mean")  # from batch 2 on
    got = [list(s) for s in shares]
    assert [len(g) for g in got] == [len(x) for x in stock]
    for k in range(len(stock[0])):
        assert sorted(sum((g[k] for g in got), [])) == sorted(sum((x[k] for x in stock), []))
        sizes = [len(g[k]) for g in got]
        if k < 2:
            assert sizes == [len(x[k]) for x in stock]
        elif sum(sizes) == 12:
            assert sizes == [7, 3, 2]
    factors = [[f for f, _ in s._pending] for s in shares]  # noqa: SLF001
    assert factors[0][:2] == [1.0, 1.0] and factors[0][2] == pytest.approx(7 * 3 / 12)
    assert factors[2][2] == pytest.approx(2 * 3 / 12)


def test_batch_sampler_over_a_distributed_sampler_is_balanced_like_batch_size():
    from memrt.balance.loader import balanced_sampler_for

    stock = _stock(50, 2, 4, True, False, True)
    for r in range(2):
        s = DistributedSampler(range(50), num_replicas=2, rank=r, shuffle=True, seed=5)
        assert list(balanced_sampler_for(None, BatchSampler(s, 4, True), 1, False)) == stock[r]


def test_a_change_behind_the_draws_is_refused_and_sum_losses_get_no_factor():
    s = _share(40, 2, 4, True, False, False, 0)
    it = iter(s)
    next(it), next(it)
    with pytest.raises(RuntimeError, match="behind"):
        s.schedule((0, 1), (6, 2), "mean")
    s.schedule((0, 2), (6, 2), "sum")
    assert len(next(it)) == 6 and s._pending[-1][0] == 1.0  # noqa: SLF001


def test_consumption_follows_the_draw_order():
    s = _share(40, 2, 4, True, False, False, 0)
    s.schedule((0, 1), (6, 2), "mean")
    it = iter(s)
    next(it), next(it), next(it)  # drawn ahead (prefetch)
    s.note_consumed()
    assert s.current == (1.0, 4)
    s.note_consumed()
    assert s.current == (pytest.approx(1.5), 6)


def test_accelerate_shard_is_replayed_exactly():
    accel = pytest.importorskip("accelerate.data_loader")
    for split, even, drop in [(False, True, False), (False, False, False), (True, True, False), (False, True, True)]:
        world, n, b = 3, 29, 4 if not split else 6
        stock = []
        for r in range(world):
            inner = BatchSampler(range(n), b, drop)
            stock.append([list(x) for x in accel.BatchSamplerShard(inner, world, r, split_batches=split,
                                                                     even_batches=even)])
        for r in range(world):
            shard = accel.BatchSamplerShard(BatchSampler(range(n), b, drop), world, r, split_batches=split,
                                            even_batches=even)
            assert unbalanced_reason(range(n), None, shard, None) is None
            share = ShareSampler(_AccelerateSource(shard))
            assert list(share) == stock[r] and len(share) == len(stock[r])


def test_what_is_left_unbalanced_and_why():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield 1

    ds = list(range(10))
    assert "iterable" in unbalanced_reason(Stream(), None, None, 4)
    assert "no DistributedSampler" in unbalanced_reason(ds, None, None, 4)
    assert "custom batch_sampler" in unbalanced_reason(ds, None, BatchSampler(range(10), 2, False), 1)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    assert unbalanced_reason(ds, sampler, None, 4) is None
    assert unbalanced_reason(ds, None, BatchSampler(sampler, 4, True), 1) is None

    class MyBatches(BatchSampler):
        pass

    assert "custom batch_sampler" in unbalanced_reason(ds, None, MyBatches(sampler, 4, True), 1)
    assert "automatic batching" in unbalanced_reason(ds, sampler, None, None)

    class Custom(DistributedSampler):
        def __iter__(self):
            return iter(range(3))

    assert "overrides" in unbalanced_reason(ds, Custom(ds, num_replicas=2, rank=0), None, 4)


def test_loss_reduction_is_read_from_the_autograd_graph():
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0])
    ce = F.cross_entropy
    assert classify_loss(ce(x, y)) == "mean"
    assert classify_loss(ce(x, y) / 4) == "mean"  # gradient accumulation
    assert classify_loss(ce(x, y) * torch.tensor(65536.0)) == "mean"  # GradScaler
    assert classify_loss(ce(x, y) + 0.1 * x.pow(2).mean()) == "mean"
    assert classify_loss(F.mse_loss(x, torch.zeros(4, 3))) == "mean"
    assert classify_loss(ce(x, y, reduction="sum")) == "sum"
    assert classify_loss(ce(x, y, reduction="sum") * 2) == "sum"
    assert classify_loss(ce(x, y, reduction="sum") / torch.tensor(7.0)) == "unknown"  # local or global count?
    assert classify_loss(ce(x, y) + ce(x, y, reduction="sum")) == "unknown"
    assert classify_loss(x.sum(0)) == "unknown"  # not a scalar
    assert classify_loss((x.exp() * 2).log().max()) == "unknown"




def _controller(mode="auto"):
    ctl = Controller(store=DictStore(), rank=0, world=2, config=AutoBalanceConfig(mode=mode))
    share = _share(64, 2, 8, True, False, False, 0)
    ctl.add_loader(share)  # the controller holds it weakly, as its DataLoader would hold it strongly
    _KEEP.append(share)
    return ctl


_KEEP: list = []


def _figures(models, reduction="mean", drawn=3, between=True, forward=None):
    """Each rank's exchanged figures from (a, c): a step of 8 samples takes a + 8 c seconds between all-reduces;
    ``forward``: its samples/s from forward to last bucket (default: the same)."""
    return [{"sps": 8 / (a + 8 * c), "sps_forward": (forward or {}).get(r, 8 / (a + 8 * c)), "between": between,
             "bound": None, "reduction": reduction, "root": "", "accum": 1, "loaders": [[0, drawn, 3, True, 16]]}
            for r, (a, c) in enumerate(models)]


def test_decisions_need_a_confirmed_imbalance_a_known_reduction_and_a_gain():
    ctl = _controller()
    assert not ctl.decide(_figures([(0.0, 0.001), (0.0, 0.00104)]))["changed"]  # equal within noise
    first = ctl.decide(_figures([(0.0, 0.001), (0.0, 0.003)]))
    assert not first["changed"] and first["confirm"]  # auto: one more window first
    second = ctl.decide(_figures([(0.0, 0.001), (0.0, 0.003)], drawn=5))
    assert second["changed"] and second["shares"] == [12, 4] and second["loaders"][0]["from"] == [0, 5]
    assert ctl.loaders[0].shares_at((0, 5))[0] == (12, 4) and ctl.loaders[0].shares_at((0, 4))[0] is None
    # from a balanced split (the ranks have drawn past the change) shares move when the predicted gain passes
    # refine_gain: 12 / 4 -> 13 / 3 at these speeds gains 9%
    ctl.loaders[0].iteration, ctl.loaders[0].drawn = 0, 9
    slower = _figures([(0.0, 0.001), (0.0, 1 / 280)], drawn=9)
    ctl.config.refine_gain = 0.10
    kept = ctl.decide(slower)
    assert not kept["changed"] and kept["shares"] == [12, 4] and "below 10%" in kept["reason"], kept
    ctl.config.refine_gain = 0.03
    moved = ctl.decide(slower)
    assert moved["changed"] and moved["shares"] == [13, 3] and 0.08 < moved["predicted_gain"] < 0.10, moved

    unknown = _controller().decide(_figures([(0.0, 0.001), (0.0, 0.003)], reduction="unknown"))
    assert not unknown["changed"] and "cannot be known" in unknown["reason"] and unknown["warn"]
    on = _controller("on").decide(_figures([(0.0, 0.001), (0.0, 0.003)], reduction="unknown"))
    assert on["changed"] and on["assumed"]  # MEMRT_BALANCE=on: no confirmation, a mean assumed


def test_one_kind_of_window_for_every_rank():
    """When one rank cannot time between all-reduces (CUDA, or collectives memrt does not see), every rank's
    forward-to-last-bucket speed decides; otherwise the between-all-reduces one."""
    figures = _figures([(0.0, 0.001), (0.0, 0.003)], forward={0: 1000.0, 1: 1000.0})
    both = _controller("on").decide(figures)
    assert both["changed"] and both["timed"] == "between all-reduces" and both["shares"] == [12, 4]
    figures[1]["between"] = False
    mixed = _controller("on").decide(figures)
    assert mixed["timed"] == "forward to last bucket" and mixed["samples_per_s"] == [1000.0, 1000.0]
    assert mixed["shares"] == [8, 8] and not mixed["changed"]


def test_a_dropped_dataloader_leaves_the_controller():
    ctl = Controller(store=DictStore(), rank=0, world=2, config=AutoBalanceConfig())
    ctl.add_loader(_share(64, 2, 8, True, False, False, 0))
    assert ctl.loaders == [None] and ctl.figures()["loaders"][0][0] == -2


def test_report_of_a_controller_without_decisions():
    r = _controller().report()
    assert r["shares"] is None and r["decisions"] == [] and r["mode"] == "auto"


def test_memory_bound_goes_into_the_exchange_and_caps_the_shares():
    ctl = _controller()
    ctl.memory_bound = lambda local: 10  # this rank's budget holds 10 samples per step
    ctl.feed.step_samples = 8
    assert ctl.figures()["bound"] == 10
    figures = _figures([(0.0, 0.001), (0.0, 0.004)])
    figures[0]["bound"] = 10
    ctl.decider.confirmed = True
    d = ctl.decide(figures)
    assert d["changed"] and d["shares"] == [10, 6]  # speeds alone would give 13 / 3


def test_new_shares_start_with_a_gradient_accumulation_window():
    ctl = _controller()
    ctl.decider.confirmed = True
    figures = _figures([(0.0, 0.001), (0.0, 0.003)], drawn=7)
    for f in figures:
        f["accum"] = 4
        f["loaders"][0][2] = 5  # the window of this step began at batch 4 (5 consumed)
    d = ctl.decide(figures)
    assert d["changed"] and d["loaders"][0]["from"] == [0, 8]  # first window start >= every rank's draws (7)


def test_speed_is_the_median_of_the_latest_steps_across_exchanges():
    """One exchange's window is short and noisy: a rank's speed pools its latest ``speed_steps`` timed steps,
    whatever exchanges fell between them, and forgets older ones."""
    ctl = Controller(store=DictStore(), rank=0, world=1, config=AutoBalanceConfig(speed_steps=5))
    share = _share(64, 1, 8, True, False, False, 0)
    ctl.add_loader(share)
    for seconds in (0.1, 0.1, 0.1):
        ctl.timer.meter.record(8, seconds, seconds)  # a step of 8 samples, 80 samples/s
    ctl.check()  # an exchange (a one-rank world: the store holds only this rank's figures)
    assert ctl.decisions[-1]["samples_per_s"] == [pytest.approx(80.0)]
    for seconds in (0.2, 0.2):
        ctl.timer.meter.record(8, seconds, seconds)  # a slower stretch: 40 samples/s
    assert ctl.timer.samples_per_s() == pytest.approx(80.0)  # 3 of 5 steps still at 80
    ctl.timer.meter.record(8, 0.2, 0.2)
    assert ctl.timer.samples_per_s() == pytest.approx(40.0)  # the first step left the window: 2 at 80, 3 at 40
    with pytest.raises(ValueError, match="speed_steps"):
        AutoBalanceConfig(speed_steps=0)
