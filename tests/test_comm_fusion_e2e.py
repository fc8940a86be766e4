"""One 4-rank job (2 fake nodes x 2): probe + cache, fusion (explicit and automatic), compression through
memrt.comm (inter hop only, ints exact; the 2-rank all-gather path and the 4-rank two-phase path), DDP with
the int8 error-feedback hook. One spawn keeps it within the time budget."""

import pytest
import torch


def _e2e(rank, world):
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memrt.comm as dist
    from memrt.comm import api, probe
    from memrt.comm.compress import get_error_feedback
    from memrt.comm.setup import override
    from memrt.profiling.recorder import get_recorder
    from memrt.testing.models import GPT, GPTConfig, lm_loss

    import time

    t0 = time.perf_counter()
    api.setup_topology(health=False)
    topo = dist.get_topology()
    out = {"links_probed": topo.links is not None and topo.links.inter is not None,
           "overhead_keys": sorted(topo.links.call_overhead_s), "mid_keys": sorted(topo.links.mid_overhead_s)}
    probe.clear_memo()
    model2, probed = probe.ensure_link_model(topo.nodes, topo.device_kinds)
    out["cache_hit"] = (not probed) and model2 == topo.links  # same model on every rank, loaded not probed
    out["t_probe"] = time.perf_counter() - t0
    rec = get_recorder()
    out["probe_records"] = len(rec.comm)  # the probe's calibration calls are memrt's, not the job's

    # comm_mode forces one algorithm for the calls inside it (what the probe and the sweep time with)
    b = torch.full((64,), float(rank))
    for mode in ("hier", "flat"):
        with dist.comm_mode(mode):
            dist.broadcast(b, src=0)
    out["forced"] = [r.algorithm for r in rec.comm[-2:]]
    out["broadcast_equal"] = torch.equal(b, torch.zeros(64))
    try:
        with dist.comm_mode("fastest"):
            pass
        out["bad_mode"] = None
    except ValueError as exc:
        out["bad_mode"] = str(exc)

    # fusion: integer-valued floats, so any summation order gives the same bits as separate calls
    ts = [torch.full((k + 1, 3), float(rank + k)) for k in range(40)]
    ref = [t.clone() for t in ts]
    for r in ref:
        tdist.all_reduce(r)
    rec.clear()
    dist.all_reduce_coalesced(ts)
    out["coalesced_equal"] = all(torch.equal(a, b) for a, b in zip(ts, ref))
    out["coalesced_calls"] = len(rec.comm)
    ts2 = [torch.full((5,), float(rank * k)) for k in range(30)]
    ref2 = [t.clone() for t in ts2]
    for r in ref2:
        tdist.all_reduce(r)
    rec.clear()
    works = [dist.all_reduce(t, async_op=True) for t in ts2]
    for w in works:
        w.wait()
    out["auto_equal"] = all(torch.equal(a, b) for a, b in zip(ts2, ref2))
    out["auto_calls"] = len(rec.comm)

    # compression through memrt.comm: floats close and identical on all ranks, ints exact, inter bytes shrink
    with override(comm="hier", compress="int8"):
        x = torch.randn(300_000, generator=torch.Generator().manual_seed(rank))
        exact = x.clone()
        tdist.all_reduce(exact)
        rec.clear()
        dist.all_reduce(x, compress="int8")  # MEMRT_COMPRESS alone compresses gradients (DDP), not plain calls
        gathered = [torch.empty_like(x) for _ in range(world)]
        tdist.all_gather(gathered, x)
        out["compressed_identical"] = all(torch.equal(gathered[0], g) for g in gathered)
        out["compressed_rel_err"] = ((x - exact).abs().max() / exact.abs().max()).item()
        out["compressed_record"] = (rec.comm[0].algorithm, rec.comm[0].tier_bytes, rec.comm[0].predicted_seconds)
        # four ranks in one group: the compressed all-to-all reduce-scatter + all-gather path, with feedback
        from memrt.comm.compress import compressed_all_reduce

        y = torch.randn(10_001, generator=torch.Generator().manual_seed(rank))
        y_exact = y.clone()
        tdist.all_reduce(y_exact)
        compressed_all_reduce(y, None, "int8", key="world4")
        tdist.all_gather(gathered[:], torch.nn.functional.pad(y, (0, x.numel() - y.numel())))
        out["two_phase_identical"] = all(torch.equal(gathered[0], g) for g in gathered)
        out["two_phase_rel_err"] = ((y - y_exact).abs().max() / y_exact.abs().max()).item()
        ints = torch.arange(100_000, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(ints, compress="int8")
        out["ints_exact"] = torch.equal(ints, torch.arange(100_000, dtype=torch.int64) * 10)

        # DDP: exact vs int8 + error feedback on the inter hop, same seeds and data

    cfg = GPTConfig(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0)
    losses = {}
    for arm in ("exact", "int8"):
        torch.manual_seed(0)
        model = DDP(GPT(cfg), bucket_cap_mb=1)
        if arm == "int8":
            get_error_feedback().clear()
            dist.register_ddp_hook(model, compress="int8")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rec.clear()
        for step in range(15):
            g = torch.Generator().manual_seed(100 * step + rank)
            start = torch.randint(0, 32, (4, 1), generator=g)
            data = torch.cat([start + i for i in range(cfg.seq_len + 1)], dim=1) % 32
            loss = lm_loss(model(data[:, :-1]), data[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[arm] = loss.item()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        same = [torch.empty_like(flat) for _ in range(world)]
        tdist.all_gather(same, flat)
        out[f"ddp_{arm}_params_identical"] = all(torch.equal(same[0], s) for s in same)
        out[f"ddp_{arm}_algorithms"] = sorted({r.algorithm for r in rec.comm if r.op == "all_reduce"})
    out["ddp_losses"] = losses
    out["t_total"] = time.perf_counter() - t0
    ef = get_error_feedback()
    out["ef_keys"] = len(ef)
    out["ef_residual_nonzero"] = any(ef.residual(k).abs().sum().item() > 0 for k in list(ef._residuals))
    tdist.barrier()
    return out


@pytest.mark.slow
def test_fusion_compression_ddp_ef_probe_cache_on_two_fake_nodes(tmp_path):
    from memrt.testing import run_processes

    res = run_processes(_e2e, 4, env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_REPORT_DIR": str(tmp_path)}, timeout=240)
    assert list(tmp_path.glob("comm-links-*.json")), "probe result not cached"
    for r in res:
        assert r["links_probed"] and r["cache_hit"]
        assert r["probe_records"] == 0 and r["forced"] == ["hier", "flat"] and r["broadcast_equal"]
        assert "MEMRT_COMM" in r["bad_mode"] and "fastest" in r["bad_mode"]
        ops = [f"{op}:{a}" for op in ("all_gather", "broadcast", "reduce_scatter") for a in ("flat", "hier")]
        assert r["overhead_keys"] == r["mid_keys"] == sorted(ops + ["flat", "hier"])  # every op's own call overhead
        assert r["coalesced_equal"] and r["coalesced_calls"] == 1  # 40 tensors, one collective
        assert r["auto_equal"] and r["auto_calls"] < 30  # back-to-back async calls were fused
        assert r["compressed_identical"] and r["compressed_rel_err"] < 0.02
        algo, tiers, predicted = r["compressed_record"]
        assert algo == "hier+int8" and predicted is not None and predicted > 0
        assert tiers["inter"] <= 300_000 * 4 / 2 / 4 * 1.01  # a quarter of the exact shard crosses nodes
        assert r["two_phase_identical"] and r["two_phase_rel_err"] < 0.03
        assert r["ints_exact"]
        assert r["ddp_exact_params_identical"] and r["ddp_int8_params_identical"]
        assert r["ddp_int8_algorithms"] == ["hier+int8"] and "hier+int8" not in r["ddp_exact_algorithms"]
        assert r["ef_keys"] > 0 and r["ef_residual_nonzero"]  # error feedback carried residuals per bucket
        exact, int8 = r["ddp_losses"]["exact"], r["ddp_losses"]["int8"]
        assert abs(int8 - exact) / exact < 0.05, r["ddp_losses"]
