"""Offload options and costs for the planner, bandwidth probe cache, pinned-pool allocator, CUDA host tier."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from memrt.memory.offload import Bandwidths, load_bandwidths, offload_options
from memrt.memory.offload.host import HostPool
from memrt.memory.profile import UnitProfile

MiB = 2**20


pytestmark = pytest.mark.usefixtures("one_thread")


def _unit(**kw) -> UnitProfile:
    base = dict(index=0, name="blocks.0", saved_bytes=40 * MiB, input_bytes=2 * MiB, saved_not_input_bytes=38 * MiB,
                forward_seconds=0.05, forward_start_bytes=0, forward_keep_transient_bytes=44 * MiB,
                forward_recompute_transient_bytes=10 * MiB, has_backward=True, backward_start_bytes=0,
                backward_recompute_transient_bytes=44 * MiB, backward_transient_bytes=48 * MiB)
    base.update(kw)
    return UnitProfile(**base)


def _bw(disk=1e9, copy=None) -> Bandwidths:
    return Bandwidths(device="x", disk_write_bytes_per_s=disk, disk_read_bytes_per_s=disk,
                      d2h_bytes_per_s=copy, h2d_bytes_per_s=copy)


def test_cpu_gets_disk_options_only():
    opts = {o.action: o for o in offload_options(_unit(), _bw(copy=20e9), "cpu", tiers=("disk", "host"))}
    assert set(opts) == {"offload_disk", "recompute+offload_disk"}


def test_cuda_gets_host_options_when_copies_were_measured():
    acts = {o.action for o in offload_options(_unit(), _bw(copy=20e9), "cuda")}
    assert {"offload_host", "recompute+offload_host", "offload_disk", "recompute+offload_disk"} <= acts
    assert not any("host" in o.action for o in offload_options(_unit(), _bw(copy=None), "cuda"))


def test_costs_follow_bandwidth_overlap_and_count_inflight_memory():
    u = _unit()
    fast = {o.action: o for o in offload_options(u, _bw(disk=10e9), "cpu")}
    slow = {o.action: o for o in offload_options(u, _bw(disk=100e6), "cpu")}
    # 40 MiB at 10 GB/s = 4 ms per direction, hidden behind 0.5 x (2 x 50 ms) of forward: nothing exposed
    assert fast["offload_disk"].added_seconds == 0.0
    # 40 MiB at 100 MB/s = 0.42 s per direction, of which 0.05 (fwd) / 0.05 (bwd) hidden
    assert slow["offload_disk"].added_seconds == pytest.approx(2 * (40 * MiB / 100e6) - 0.05 - 0.05)
    assert slow["recompute+offload_disk"].added_seconds == pytest.approx(0.05 + 2 * max(0, 2 * MiB / 100e6 - 0.05))
    full, rec = fast["offload_disk"], fast["recompute+offload_disk"]
    assert full.resident_bytes == 0 and full.inflight_bytes == 40 * MiB  # prefetch / pending writes on device
    assert rec.resident_bytes == 0 and rec.inflight_bytes == 2 * MiB
    assert rec.backward_transient_bytes >= 2 * MiB + 44 * MiB  # inputs back + the replayed unit
    assert full.backward_transient_bytes == 40 * MiB + (48 - 38) * MiB  # loaded + a kept unit's temporaries


def test_duck_typed_profile_is_accepted():
    @dataclass
    class P:
        saved_bytes: int
        forward_seconds: float

    (o,) = offload_options(P(saved_bytes=MiB, forward_seconds=0.01), _bw(), "cpu")
    assert o.action == "offload_disk" and o.resident_bytes == 0


def test_bandwidths_probed_once_and_cached(tmp_path):
    cache = tmp_path / "bw.json"
    a = load_bandwidths("cpu", str(tmp_path), cache_path=cache)
    b = load_bandwidths("cpu", str(tmp_path), cache_path=cache)
    assert a == b and a.disk_write_bytes_per_s > 0 and a.disk_read_bytes_per_s > 0 and a.d2h_bytes_per_s is None
    assert Bandwidths.from_json(a.to_json()) == a
    assert [p.name for p in tmp_path.iterdir()] == ["bw.json"]  # the probe folder is gone


def test_pool_reuses_its_buffers():
    pool = HostPool(1 * MiB, pin=False)
    blocks = [pool.alloc(100_000) for _ in range(8)]
    assert pool.allocations == 1 and pool.used_bytes >= 800_000
    for b in blocks[::2]:
        pool.free(b)
    for b in blocks[1::2]:
        pool.free(b)
    assert pool.used_bytes == 0 and pool._free == [[(0, 1 * MiB, ())]]  # coalesced back to one range
    for _ in range(5):  # steady state: same sizes every "step", no new buffers
        bs = [pool.alloc(n) for n in (300_000, 200_000, 400_000)]
        for b in bs:
            pool.free(b)
    assert pool.allocations == 1 and pool.peak_bytes <= 1 * MiB
    big = pool.alloc(2 * MiB)  # more than planned: grows once, counted
    assert pool.allocations == 2 and big[3].numel() == 2 * MiB
    pool.free(big)
    for _ in range(3):  # next steps: the grown pool is reused as it is (never re-allocated merged: the old
        bs = [pool.alloc(n) for n in (2 * MiB, MiB // 2)]  # buffers would stay in torch's pinned cache)
        for b in bs:
            pool.free(b)
    assert pool.allocations == 2 and pool.capacity_bytes == 3 * MiB


class _FakeEvent:
    """A CUDA event stand-in: ``query`` says whether the copy finished; ``synchronize`` must never be needed."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("the pool synchronised on an event (a host stall): stream order protects reuse")


def test_pool_short_reuses_pending_ranges_without_host_sync():
    pool = HostPool(1 * MiB, pin=False)
    a, b = pool.alloc(MiB // 2), pool.alloc(MiB // 2)
    busy, done = _FakeEvent(False), _FakeEvent(True)
    pool.free(a, busy)  # its last copy is still queued
    pool.free(b, done)
    c = pool.alloc(MiB // 2)  # the finished range first, nothing to wait for
    assert (c[0], c[1]) == (b[0], b[1]) and pool.last_waits == ()
    d = pool.alloc(MiB // 2)  # short: the busy range, handed out with its event for a GPU-side wait
    assert (d[0], d[1]) == (a[0], a[1]) and pool.last_waits == (busy,)
    assert pool.allocations == 1  # no new pinned buffer, no host synchronisation


def test_pool_presized_from_the_plan_covers_alignment():
    from memrt.memory.offload.host import pool_bytes_for

    sizes = [64 * 1024 + 1] * 200 + [3 * MiB + 7] * 10  # odd sizes: every range rounds up to 512 bytes
    pool = HostPool(pool_bytes_for(sum(sizes)), pin=False)
    blocks = [pool.alloc(n) for n in sizes]
    assert pool.allocations == 1, "the plan-sized pool had to grow mid-forward"
    for blk in blocks:
        pool.free(blk)
    assert pool_bytes_for(0) == 0


@pytest.mark.slow
def test_planner_budget_below_checkpoint_every_block_is_met(tmp_path):
    """memrt.plan with the disk tier fits a budget no keep/recompute plan fits, and the step stays under it."""
    import memrt
    from memrt.memory.planner import min_feasible_budget
    from memrt.profiling.cpu_tracker import CpuMemoryTracker
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=12, d_model=32, seq_len=64, n_head=1, dropout=0.0)
    x, y = gpt_batch(cfg, 16)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()

    step()
    prof = memrt.profile(model, step)
    recompute_floor = min_feasible_budget(prof)
    budget = min_feasible_budget(prof, offload="disk", bandwidths=load_bandwidths("cpu", str(tmp_path),
                                                                               cache_path=tmp_path / "bw.json"))
    assert budget < 0.9 * recompute_floor
    budget = int(budget * 1.08)  # predicted vs measured peak within 8% (the planner re-plans on overshoot)
    plan = memrt.plan(prof, budget, offload="disk")
    assert any("offload_disk" in u.action for u in plan.units)
    memrt.apply(model, plan, offload_dir=str(tmp_path))
    try:
        step()
        # count this job's tensors only (a gc scan would also count what earlier tests left alive)
        own = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None] + [x, y]
        own += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        tracker = CpuMemoryTracker().start(own, scan_gc=False)
        del own  # holding last step's gradients would keep them alive through zero_grad
        try:
            step()
        finally:
            tracker.stop()
    finally:
        memrt.disable(model)
    assert tracker.peak_bytes <= budget, (tracker.peak_bytes, budget, str(plan))


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_tiers_gradients_equal_and_pool_reused(tier, tmp_path):
    from memrt.memory.offload import offload_units
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=4, d_model=256, seq_len=256, dropout=0.1)
    x, y = gpt_batch(cfg, 8, device="cuda")
    torch.manual_seed(0)
    ref = GPT(cfg).cuda()
    model = copy.deepcopy(ref)

    def run(m):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        lm_loss(m(x), y).backward()
        return [p.grad.clone() for p in m.parameters()]

    want = run(ref)
    kw = {"host_pool_bytes": 512 * MiB} if tier == "host" else {"directory": tmp_path}
    for recompute in (False, True):
        with offload_units(model, list(model.blocks), tier, recompute=recompute, **kw) as h:
            got = [run(model) for _ in range(3)]
            s = h.stats()
        for g in got:
            for a, b in zip(g, want):
                assert torch.equal(a, b)
        assert s.bytes_offloaded > 0 and s.bytes_restored > 0
        if tier == "host":  # pre-sized pool: one pinned buffer, reused every step
            assert s.pinned_allocations == 1 and s.host_peak_bytes <= s.host_pool_capacity_bytes
