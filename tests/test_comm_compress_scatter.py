"""Compressed reduce-scatter: the slow hop of the hierarchical reduce-scatter in bf16 / fp16 / int8.

4 ranks, 2 fake nodes x 2 (``MEMRT_TOPOLOGY=0,1;2,3``), calls asking ``compress=`` directly: results within
the codec's error of torch's reduce-scatter, all-zero blocks exactly zero, inf and NaN where torch puts
them, the same bits on every repeat, fewer bytes on the inter tier, and error feedback that returns what
a call dropped to the next call of the same key (never to a call without one).
"""

import pytest
import torch

from memrt.testing import run_processes

ENV = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier"}
BOUND = {"bf16": 1e-2, "fp16": 1e-3, "int8": 1e-2}
"""Largest |error| / max |exact| of one call (per-value rounding, int8: per-chunk scale / 127 per term)."""


def _scatter_calls(rank, world):
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm.compress import FeedbackKey, get_error_feedback
    from memrt.profiling.recorder import get_recorder

    dist.setup_topology(health=False)
    rec = get_recorder()
    out = {}
    for codec in ("bf16", "fp16", "int8"):
        for m in (70_001, 1, 5):  # an odd block, one element, a tail shorter than an int8 chunk
            x = torch.randn(world * m, generator=torch.Generator().manual_seed(10 * rank + m))
            ref = torch.empty(m)
            tdist.reduce_scatter_tensor(ref, x.clone())
            got = torch.empty(m)
            rec.clear()
            dist.reduce_scatter_tensor(got, x.clone(), compress=codec)
            again = torch.empty(m)
            dist.reduce_scatter_tensor(again, x.clone(), compress=codec)
            out[f"{codec}/{m}/err"] = ((got - ref).abs().max() / ref.abs().max()).item()
            out[f"{codec}/{m}/repeat_equal"] = torch.equal(got, again)
            out[f"{codec}/{m}/records"] = [(r.algorithm, r.tier_bytes["inter"], r.tier_bytes["intra"]) for r in rec.comm]
        z = torch.zeros(world * 4099)
        zo = torch.ones(4099)
        dist.reduce_scatter_tensor(zo, z, compress=codec)
        out[f"{codec}/zero_max"] = zo.abs().max().item()
        s = torch.randn(world * 4099, generator=torch.Generator().manual_seed(rank))
        s[4099 * 0 + 11] = float("inf") if rank == 2 else 1.0  # rank 2 (other node) sends inf to rank 0
        s[4099 * 1 + 12] = float("nan") if rank == 3 else 1.0  # rank 3 sends NaN to rank 1
        s[4099 * 2 + 13] = -float("inf") if rank == 0 else 1.0
        sref, sgot = torch.empty(4099), torch.empty(4099)
        tdist.reduce_scatter_tensor(sref, s.clone())
        dist.reduce_scatter_tensor(sgot, s.clone(), compress=codec)
        out[f"{codec}/special"] = (torch.equal(torch.isnan(sgot), torch.isnan(sref)),
                                   torch.equal(torch.isposinf(sgot), torch.isposinf(sref)),
                                   torch.equal(torch.isneginf(sgot), torch.isneginf(sref)),
                                   int((~torch.isfinite(sref)).sum()))
        avg, avg_ref = torch.empty(70_001), torch.empty(70_001)
        xa = torch.randn(world * 70_001, generator=torch.Generator().manual_seed(rank))
        tdist.reduce_scatter_tensor(avg_ref, xa.clone())
        dist.reduce_scatter_tensor(avg, xa.clone(), op=tdist.ReduceOp.AVG, compress=codec)
        out[f"{codec}/avg_err"] = ((avg * world - avg_ref).abs().max() / avg_ref.abs().max()).item()
        half = xa.to(torch.bfloat16)
        hout, href = torch.empty(70_001, dtype=torch.bfloat16), torch.empty(70_001, dtype=torch.bfloat16)
        tdist.reduce_scatter_tensor(href, half.clone())
        dist.reduce_scatter_tensor(hout, half.clone(), compress=codec)
        out[f"{codec}/bf16_input_err"] = ((hout.float() - href.float()).abs().max() / href.float().abs().max()).item()

    # error feedback: the mean of T keyed calls of one gradient approaches the exact sum like 1/T
    ef = get_error_feedback()
    ef.clear()
    g = torch.randn(world * 50_000, generator=torch.Generator().manual_seed(7 + rank))
    exact = torch.empty(50_000)
    tdist.reduce_scatter_tensor(exact, g.clone())
    key = FeedbackKey(owner=("test", "grad"))
    outs = []
    for _ in range(16):
        o = torch.empty(50_000)
        dist.reduce_scatter_tensor(o, g.clone(), compress="int8", key=key)
        outs.append(o)
    scale = exact.abs().max()
    out["ef_one"] = ((outs[0] - exact).abs().max() / scale).item()
    out["ef_mean"] = ((torch.stack(outs).mean(0) - exact).abs().max() / scale).item()
    out["ef_keys"] = len(ef)
    plain = torch.empty(50_000)
    dist.reduce_scatter_tensor(plain, g.clone(), compress="int8")  # no key: no residual taken or left
    out["plain_equals_first"] = torch.equal(plain, outs[0])
    out["ef_keys_after_plain"] = len(ef)
    try:
        dist.reduce_scatter_tensor(torch.empty(1), torch.zeros(world), compress="int4")
        out["bad"] = "no error"
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.slow
def test_compressed_reduce_scatter_on_two_nodes():
    res = run_processes(_scatter_calls, 4, env=ENV, timeout=240)
    for rank, r in enumerate(res):
        for codec in ("bf16", "fp16", "int8"):
            for m in (70_001, 1, 5):
                assert r[f"{codec}/{m}/err"] <= BOUND[codec], (rank, codec, m, r[f"{codec}/{m}/err"])
                assert r[f"{codec}/{m}/repeat_equal"], (rank, codec, m)
                recs = r[f"{codec}/{m}/records"]
                assert [a for a, _, _ in recs] == [f"hier+{codec}"] * 2, recs
            exact_inter = 70_001 * 4  # one float32 block crosses to the other node
            inter = r[f"{codec}/70001/records"][0][1]
            assert inter <= exact_inter * (0.26 if codec == "int8" else 0.5) + 64, (codec, inter)
            assert r[f"{codec}/zero_max"] == 0.0
            nan_same, pinf_same, ninf_same, specials = r[f"{codec}/special"]
            assert nan_same and pinf_same and ninf_same, (rank, codec, r[f"{codec}/special"])
            assert specials == (1 if rank in (0, 1, 2) else 0)
            assert r[f"{codec}/avg_err"] <= BOUND[codec]
            assert r[f"{codec}/bf16_input_err"] <= BOUND[codec] + 2e-2
        assert r["ef_mean"] < 0.25 * r["ef_one"], (r["ef_one"], r["ef_mean"])
        assert r["ef_keys"] > 0 and r["ef_keys_after_plain"] == r["ef_keys"]
        assert r["plain_equals_first"], "a call without a key must not take the keyed residual"
        assert "compress='int4' is not valid" in r["bad"], r["bad"]
