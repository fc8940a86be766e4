"""Mixed device kinds: backend choice per group, host staging, DDP through the staged path (CPU, forced kinds)."""

import numpy as np
import pytest

from memrt.comm.mixed import BackendChoice, MixedComm, choose_backend, forced_device_kind
from memrt.testing import run_processes


def test_choose_backend_native_when_all_members_share_a_kind():
    c = choose_backend(["cuda", "cuda"], available=["nccl", "gloo"])
    assert (c.backend, c.staged) == ("nccl", (False, False))
    assert choose_backend(["xpu"] * 3, available=["xccl", "gloo"]).backend == "xccl"
    assert choose_backend(["cpu", "cpu"], available=["gloo"]).staged == (False, False)


def test_choose_backend_stages_mixed_or_unsupported_kinds_through_host():
    c = choose_backend(["cuda", "cpu", "cuda"], available=["nccl", "gloo"])
    assert (c.backend, c.staged) == ("gloo", (True, False, True))
    assert "mixed kinds cpu+cuda" in c.reason
    c = choose_backend(["cuda", "cuda"], available=["gloo"])  # no nccl in this build
    assert (c.backend, c.staged) == ("gloo", (True, True)) and "nccl not available" in c.reason
    assert choose_backend(["mps", "mps"], available=["gloo"]).staged == (True, True)
    assert "host copy" in c.table() and "cuda" in c.table()
    with pytest.raises(ValueError, match="kinds is empty"):
        choose_backend([])
    with pytest.raises(RuntimeError, match="gloo is unavailable"):
        choose_backend(["cuda", "cpu"], available=["nccl"])


def test_forced_kind_setting_forms():
    assert forced_device_kind(0, raw="CUDA") == "cuda"
    assert forced_device_kind(1, raw="0=cuda,1=cpu") == "cpu"
    assert forced_device_kind(2, raw="0=cuda,1=cpu") is None
    assert forced_device_kind(0, raw="") is None
    with pytest.raises(ValueError, match="MEMRT_FORCE_DEVICE_KIND"):
        forced_device_kind(0, raw="a=cuda")


def _mixed_worker(rank, world):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memrt.balance import SpeedBalancer, BalanceConfig
    from memrt.testing.balance import Spec, make_dataset, make_model

    out = {}
    mc = MixedComm()
    out["choice"] = (mc.choice.backend, mc.choice.kinds, mc.choice.staged)
    out["own_group"] = mc.group is not None
    x = torch.arange(10, dtype=torch.float32) * (rank + 1) + 0.25
    ref = x.clone()
    dist.all_reduce(ref)
    out["all_reduce_equal"] = torch.equal(mc.all_reduce(x.clone()), ref)
    fut_t = x.clone()
    out["future_equal"] = torch.equal(mc.all_reduce_future(fut_t).wait(), ref) and torch.equal(fut_t, ref)
    b = torch.full((4,), float(rank))
    out["broadcast"] = mc.broadcast(b, src=1).tolist()
    g = torch.empty(world * 3)
    out["all_gather"] = mc.all_gather_into_tensor(g, torch.full((3,), rank + 1.0)).tolist()
    # DDP: weighted hook through the staged path, shares (5, 3); compare with full-batch training
    spec = Spec(global_batch=8, phase_steps=2, phases=1, width=32, depth=2, in_features=16)
    ds, model = make_dataset(spec), make_model(spec)
    ddp = DDP(model)
    bal = SpeedBalancer(8, shares=(5, 3), config=BalanceConfig(adaptive=False))
    bal.attach(ddp, mixed=mc)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    for xb, yb in torch.utils.data.DataLoader(ds, batch_sampler=bal.sampler(ds, seed=spec.seed)):
        opt.zero_grad(set_to_none=True)
        with bal.step(len(xb)):
            F.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    out["staged_bytes"] = mc.staged_bytes
    # kinds given (e.g. from the topology): all cpu -> gloo, the default group is reused, no staging
    same = MixedComm(kinds=["cpu", "cpu"])
    out["cpu_choice"] = (same.choice.backend, same.staging, same.group is None)
    return out


@pytest.mark.slow
def test_forced_mixed_kinds_stage_and_match_torch_distributed():
    from memrt.testing.balance import Spec, reference_params

    res = run_processes(_mixed_worker, 2, env={"MEMRT_FORCE_DEVICE_KIND": "0=cuda,1=cpu"}, timeout=240)
    r0, r1 = res
    assert r0["choice"] == r1["choice"] == ("gloo", ("cuda", "cpu"), (True, False))
    for r in res:
        assert r["all_reduce_equal"] and r["future_equal"]
        assert r["broadcast"] == [1.0] * 4
        assert r["all_gather"] == [1.0] * 3 + [2.0] * 3
        assert r["cpu_choice"] == ("gloo", False, True)
    assert r0["staged_bytes"] > 0 and r1["staged_bytes"] == 0  # only the (forced) cuda rank copies to host
    ref = reference_params(Spec(global_batch=8, phase_steps=2, phases=1, width=32, depth=2, in_features=16))
    for r in res:
        assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(r["params"], ref))


def test_backend_choice_is_a_value():
    c = BackendChoice(backend="gloo", kinds=("cpu",), staged=(False,), reason="x")
    assert c.table().splitlines()[1].split() == ["0", "cpu", "gloo", "none"]
