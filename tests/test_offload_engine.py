"""Offload engine (disk tier on CPU): bitwise-equal gradients, what is (not) offloaded, files, stats."""

from __future__ import annotations

import copy
import os
import stat

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from memrt.memory.offload import OffloadEngine, OffloadError, offload_units
from memrt.testing.models import GPT, ConvNet, GPTConfig, KwargsMLP, SharedBlockNet, gpt_batch, lm_loss


pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt():
    cfg = GPTConfig(n_layer=3, d_model=64, seq_len=32, dropout=0.1)
    x, y = gpt_batch(cfg, 4)
    return GPT(cfg), (lambda m: lm_loss(m(x), y)), lambda m: list(m.blocks)


def _data(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _conv():
    x = _data(4, 3, 16, 16)
    return ConvNet(), (lambda m: m(x).pow(2).mean()), lambda m: list(m.blocks)


def _kwargs():
    x = _data(8, 64)
    return KwargsMLP(), (lambda m: m(x).pow(2).mean()), lambda m: list(m.blocks)


def _shared():
    x = _data(8, 64)
    # the shared submodule is a unit too: it runs twice per forward (two groups, one module)
    return SharedBlockNet(), (lambda m: m(x).pow(2).mean()), lambda m: [m.shared, *m.blocks]


MODELS = {"gpt": _gpt, "convnet": _conv, "kwargs_mlp": _kwargs, "shared_block": _shared}


def _step(model, loss_fn):
    torch.manual_seed(123)  # same dropout masks in every run
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("recompute", [False, True], ids=["offload", "recompute+offload"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_bitwise_equal_disk_tier(name, recompute, tmp_path):
    torch.manual_seed(0)
    model, loss_fn, units = MODELS[name]()
    ref_model = copy.deepcopy(model)
    ref_loss, ref_grads, ref_bufs = _step(ref_model, loss_fn)
    with offload_units(model, units(model), "disk", recompute=recompute, directory=tmp_path,
                       min_bytes=1024, verify=True) as handle:
        for _ in range(2):  # a second step reuses the engine
            loss, grads, bufs = _step(model, loss_fn)
            s = handle.stats()
        model.load_state_dict(ref_model.state_dict())
    assert s.tensors_offloaded > 0 and s.bytes_restored > 0
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    if not name == "convnet":
        for b, r in zip(bufs, ref_bufs):
            assert torch.equal(b, r)
    assert list(tmp_path.iterdir()) == []  # private folder removed at close


def test_convnet_batchnorm_stats_updated_once_under_recompute(tmp_path):
    torch.manual_seed(0)
    model, loss_fn, units = _conv()
    ref = copy.deepcopy(model)
    _step(ref, loss_fn)
    with offload_units(model, units(model), "disk", recompute=True, directory=tmp_path, min_bytes=1024):
        _step(model, loss_fn)
    for b, r in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, r)


def test_through_planner_apply_seam(tmp_path):
    """A Plan with offload actions runs through memrt.apply's action registry: gradients stay bitwise equal."""
    import memrt
    from memrt.memory.planner import Plan, UnitPlan

    torch.manual_seed(0)
    model, loss_fn, _ = _gpt()
    ref = copy.deepcopy(model)
    _, ref_grads, _ = _step(ref, loss_fn)
    actions = ["offload_disk", "recompute+offload_disk", "recompute"]
    plan = Plan(units=[UnitPlan(name=f"blocks.{i}", action=a) for i, a in enumerate(actions)])
    memrt.apply(model, plan, offload_dir=str(tmp_path))
    try:
        _, grads, _ = _step(model, loss_fn)
    finally:
        memrt.disable(model)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


class _Saver(nn.Module):
    """Saves a parameter, a small tensor and two views of one big storage."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 256))

    def forward(self, x):
        big = x * 2.0  # 64 KiB storage
        a, b = big[:64], big[64:]  # two views of it
        small = x[:1].sum(dim=0, keepdim=True) * 1.0  # 1 KiB
        return (a * b).sum() + F.linear(big, self.w).sum() + (small * small).sum()


def test_params_small_tensors_and_views_are_not_offloaded_twice(tmp_path):
    m = _Saver()
    x = torch.randn(128, 256, requires_grad=True)
    with OffloadEngine("disk", directory=tmp_path, min_bytes=4096, keep=m) as engine:
        with engine.pack_hooks(0):
            out = m(x)
        engine.synchronize()
        s = engine.stats()
        out.backward()
    big_bytes = 128 * 256 * 4
    assert s.tensors_kept_param >= 1  # the weight (and the leaf input x requiring grad)
    assert s.tensors_kept_small >= 1  # the 1 KiB tensor
    assert s.tensors_deduplicated >= 1  # the second view of `big`
    assert s.bytes_offloaded == big_bytes  # the shared storage, once
    ref = _Saver()
    ref.load_state_dict(m.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).backward()
    assert torch.equal(ref.w.grad, m.w.grad) and torch.equal(x2.grad, x.grad)


def test_private_folder_modes_and_files_removed_with_the_graph(tmp_path):
    torch.manual_seed(0)
    model, loss_fn, units = _gpt()
    handle = offload_units(model, units(model), "disk", directory=tmp_path, min_bytes=1024)
    try:
        folder = handle.engine.directory
        assert folder.parent == tmp_path and stat.S_IMODE(folder.stat().st_mode) == 0o700
        loss = loss_fn(model)
        handle.engine.synchronize()
        files = list(folder.iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        s = handle.stats()
        assert s.disk_bytes > 0 and s.host_bytes == 0  # disk memory reported apart from device memory
        loss.backward()
        del loss
        handle.engine.synchronize()
        assert list(folder.iterdir()) == []  # released with the graph
        assert handle.stats().disk_bytes == 0
    finally:
        handle.close()
    assert not folder.exists()


def test_graph_dropped_without_backward_releases_files(tmp_path):
    torch.manual_seed(0)
    model, loss_fn, units = _gpt()
    with offload_units(model, units(model), "disk", directory=tmp_path, min_bytes=1024) as handle:
        loss = loss_fn(model)
        del loss
        handle.engine.synchronize()
        assert list(handle.engine.directory.iterdir()) == []


def test_exception_in_forward_leaves_no_files(tmp_path):
    class Boom(nn.Module):
        def forward(self, x):
            y = torch.tanh(x * 3.0)  # saved, offloaded
            raise RuntimeError("boom")

    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=16)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with engine.pack_hooks(0):
                Boom()(torch.randn(64, 64, requires_grad=True))
    finally:
        engine.close()
    assert list(tmp_path.iterdir()) == []


def test_prefetch_loads_ahead_of_backward(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, d_model=64, seq_len=32, dropout=0.0)
    x, y = gpt_batch(cfg, 4)
    model = GPT(cfg)
    with offload_units(model, list(model.blocks), "disk", directory=tmp_path, min_bytes=1024) as handle:
        loss = lm_loss(model(x), y)
        handle.engine.synchronize()  # everything on disk before backward
        loss.backward()
        s = handle.stats()
    assert s.bytes_restored == s.bytes_offloaded > 0
    assert s.prefetch_misses == 0 and s.prefetch_hits == s.tensors_offloaded


def test_stats_published_to_recorder(tmp_path):
    from memrt.profiling.recorder import get_recorder

    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=16)
    with engine.pack_hooks(0):
        out = torch.tanh(torch.randn(64, 64, requires_grad=True)).sum()
    engine.synchronize()  # written before backward (else backward may use the bytes still in memory)
    out.backward()
    engine.close()
    meta = get_recorder().meta["offload"]
    assert meta["tier"] == "disk" and meta["bytes_offloaded"] == 64 * 64 * 4
    assert {"host_bytes", "disk_peak_bytes", "device_held_peak_bytes"} <= set(meta)


def test_host_tier_refused_on_cpu():
    with pytest.raises(OffloadError, match="needs a CUDA device"):
        OffloadEngine("host", device="cpu")
    with pytest.raises(OffloadError, match="unknown offload tier"):
        OffloadEngine("nvme", device="cpu")
