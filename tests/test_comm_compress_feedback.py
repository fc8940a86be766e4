"""Error feedback belongs to one gradient buffer; plain all_reduce calls are exact even with MEMRT_COMPRESS.

4 ranks, 2 fake nodes x 2 (``MEMRT_TOPOLOGY=0,1;2,3``), ``MEMRT_COMM=hier``, ``MEMRT_COMPRESS=int8``: the
set-up under which an all-zero tensor came back non-zero (the residual of an earlier call of the same
size was added in), 1e-30 came back as 1e-4, and one inf turned a whole tensor into NaN.
"""

import pytest
import torch

ENV = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier", "MEMRT_COMPRESS": "int8"}
N = 1_000_003


def _direct_calls(rank, world):
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm.compress import get_error_feedback
    from memrt.profiling.recorder import get_recorder

    dist.setup_topology(health=False)
    rec = get_recorder()
    out = {}
    ef = get_error_feedback()
    for compress in (None, "int8"):  # plain calls, then calls that ask for compression by argument
        tag = compress or "plain"
        rec.clear()
        x = torch.randn(N, generator=torch.Generator().manual_seed(rank))
        ref = x.clone()
        tdist.all_reduce(ref)
        dist.all_reduce(x, compress=compress)  # leaves a residual behind if feedback were keyed by size
        out[f"{tag}_rel_err"] = ((x - ref).abs().max() / ref.abs().max()).item()
        z = torch.zeros(N)
        dist.all_reduce(z, compress=compress)
        out[f"{tag}_zero_max"] = z.abs().max().item()
        t = torch.full((N,), 1e-30)
        dist.all_reduce(t, compress=compress)
        out[f"{tag}_tiny"] = (t.min().item(), t.max().item())
        i = torch.randn(N, generator=torch.Generator().manual_seed(rank))
        i[12345] = float("inf")
        iref = i.clone()
        tdist.all_reduce(iref)
        dist.all_reduce(i, compress=compress)
        out[f"{tag}_inf"] = (bool(torch.isposinf(i[12345])), int(torch.isnan(i).sum()), int(torch.isinf(i).sum()),
                             int(torch.isnan(iref).sum()), int(torch.isinf(iref).sum()))
        out[f"{tag}_algorithms"] = sorted({r.algorithm for r in rec.comm})
        out[f"{tag}_reasons"] = sorted({r.reason for r in rec.comm})
    out["residuals"] = len(ef)
    return out


@pytest.mark.slow
def test_plain_and_explicit_calls_never_take_another_calls_residual(tmp_path):
    from memrt.testing import run_processes

    res = run_processes(_direct_calls, 4, env={**ENV, "MEMRT_REPORT_DIR": str(tmp_path)}, timeout=240)
    for r in res:
        # MEMRT_COMPRESS alone does not compress a user's all_reduce: exact hierarchical algorithm
        assert r["plain_algorithms"] == ["hier"], r
        assert r["plain_zero_max"] == 0.0
        assert r["plain_tiny"][0] == pytest.approx(4e-30, rel=1e-6) and r["plain_tiny"][1] == pytest.approx(4e-30, rel=1e-6)
        assert r["plain_inf"] == (True, 0, 1, 0, 1)
        # compress="int8" by argument: compressed, and still no residual of another call
        assert r["int8_algorithms"] == ["hier+int8"] and "compress=int8" in r["int8_reasons"][0]
        assert r["int8_rel_err"] < 0.02
        assert r["int8_zero_max"] == 0.0
        lo, hi = r["int8_tiny"]
        assert 4e-30 * (1 - 1 / 127) <= lo <= hi <= 4e-30 * (1 + 1 / 127)
        assert r["int8_inf"] == (True, 0, 1, 0, 1)  # inf where stock has it, finite everywhere else
        assert r["residuals"] == 0  # no error feedback for calls that do not name a gradient buffer
    assert all(r == res[0] for r in res[1:])


def _ddp_buckets(rank, world):
    """Two DDP models with equal-size buckets: each bucket keeps its own residual, plain calls keep none."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memrt.comm as dist
    from memrt.comm.compress import FeedbackKey, get_error_feedback

    dist.setup_topology(health=False)
    ef = get_error_feedback()
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), bucket_cap_mb=0.01)
        dist.register_ddp_hook(m, compress="int8")
        models.append(m)
    for step in range(3):
        for m in models:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 10 + rank))
            m(x).square().mean().backward()
    keys = [k for k in ef.keys() if isinstance(k, FeedbackKey)]
    owners = {k.owner for k in keys}
    before = {k: ef.residual(k).clone() for k in keys}
    y = torch.zeros(64 * 64 + 64)  # the size of a bucket, from user code
    dist.all_reduce(y)
    dist.all_reduce(y, compress="int8")
    untouched = all(torch.equal(before[k], ef.residual(k)) for k in keys)
    only_ddp = len(keys) == len(ef)
    from memrt.profiling.recorder import get_recorder

    torch.manual_seed(2)  # MEMRT_COMPRESS=auto through the hook: each bucket's record says what was chosen and why
    auto = DDP(torch.nn.Linear(256, 256), bucket_cap_mb=1)
    dist.register_ddp_hook(auto, compress="auto")
    get_recorder().clear()
    auto(torch.randn(4, 256)).sum().backward()
    reasons = [(r.algorithm, r.reason) for r in get_recorder().comm if r.op == "all_reduce"]
    return {"auto": reasons,
            "owners": sorted(map(repr, owners)), "n_models": len({o[1] for o in owners}),
            "buckets_per_model": len(owners) // 2, "zero_sum": y.abs().max().item(), "untouched": untouched,
            "all_other_keys_ddp": only_ddp}


@pytest.mark.slow
def test_ddp_residuals_per_model_and_bucket(tmp_path):
    from memrt.testing import run_processes

    res = run_processes(_ddp_buckets, 4, env={**ENV, "MEMRT_REPORT_DIR": str(tmp_path)}, timeout=240)
    for r in res:
        assert r["n_models"] == 2 and r["buckets_per_model"] >= 2, r
        assert r["zero_sum"] == 0.0 and r["untouched"] and r["all_other_keys_ddp"], r
        assert r["auto"] and all(reason.startswith("compress=auto: ") and "predicted" in reason
                                 and (algo == "hier+bf16") == (">= 10%" in reason) for algo, reason in r["auto"]), r
