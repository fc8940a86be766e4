"""Cost model formulas, the alpha-beta fit, per-call choice, the probe cache key and explain (no processes), and
`memrt bench comm` on local ranks."""

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

from memrt.comm import costmodel as cm
from memrt.comm.explain import busbw_factor, explain, explain_rows, size_bucket
from memrt.comm.probe import cache_path, fit_alpha_beta, topology_key
from memrt.comm.costmodel import predict
from memrt.comm.select import choose, tier_bytes
from memrt.config import load_config

A, B = 50e-6, 1 / 125e6  # 50 us, 1 Gbit/s
LINK = cm.TierLink(alpha_s=A, beta_s_per_byte=B)


def model(intra_bw=2e9, inter_bw=125e6, shared_factor=2.0, codec=1e-9, gamma=0.0):
    return cm.LinkModel(intra=cm.TierLink(alpha_s=20e-6, beta_s_per_byte=1 / intra_bw),
                        inter=cm.TierLink(alpha_s=100e-6, beta_s_per_byte=1 / inter_bw,
                                          shared_beta_s_per_byte=shared_factor / inter_bw),
                        gamma_s_per_byte=gamma, codec_s_per_byte={"bf16": codec, "fp16": codec, "int8": codec})


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_formula_is_the_cited_one(p):
    n = 64 * 2**20
    assert math.isclose(cm.ring_all_reduce(p, n, LINK, 0.0), 2 * (p - 1) / p * n * B + 2 * (p - 1) * A)
    assert math.isclose(cm.recursive_doubling_all_reduce(p, n, LINK, 0.0), math.log2(p) * (A + n * B))
    assert math.isclose(cm.rabenseifner_all_reduce(p, n, LINK, 0.0), 2 * math.log2(p) * A + 2 * (p - 1) / p * n * B)
    # latency-bound small messages favour recursive doubling, bandwidth-bound large ones ring/Rabenseifner
    assert cm.recursive_doubling_all_reduce(p, 8, LINK, 0) <= cm.ring_all_reduce(p, 8, LINK, 0)
    if p > 2:
        assert cm.recursive_doubling_all_reduce(p, n, LINK, 0) > cm.ring_all_reduce(p, n, LINK, 0)


def test_hierarchical_is_composed_of_its_stages():
    nodes = ((0, 1), (2, 3))
    m = model()
    n = 16 * 2**20
    expect = (cm.ring_reduce_scatter(2, n, m.intra, 0) + cm.ring_all_gather(2, n, m.intra)
              + cm.ring_all_reduce(2, n / 2, m.inter, 0, shared=True))
    assert math.isclose(cm.hierarchical_all_reduce(nodes, n, m), expect)
    # flat ring on 4 ranks crosses nodes once per direction: beta alone, not shared
    assert math.isclose(cm.flat_all_reduce(nodes, n, m), 2 * 3 / 4 * n / 125e6 + 6 * 100e-6)
    # compression shrinks only the inter hop: the intra part is the same
    intra_part = cm.ring_reduce_scatter(2, n, m.intra, 0) + cm.ring_all_gather(2, n, m.intra)
    t8 = cm.hierarchical_all_reduce(nodes, n, m, codec="int8")
    assert math.isclose(t8, intra_part + 100e-6 + n / 2 * 0.25 * 2 / 125e6 + n / 2 * 1e-9)


def test_compressed_ratio_and_bad_codec():
    assert cm.compressed_ratio("bf16") == 0.5 and cm.compressed_ratio("int8") == 0.25
    assert cm.compressed_ratio("bf16", element_size=2) == 1.0  # bf16 of bf16 saves nothing
    with pytest.raises(ValueError, match="codec"):
        cm.compressed_ratio("int4")


def test_fit_alpha_beta_recovers_line_and_clamps():
    pts = [(n, 1e-4 + n * 8e-9) for n in (8, 1 << 16, 1 << 22)]
    a, b = fit_alpha_beta(pts)
    assert math.isclose(a, 1e-4, rel_tol=1e-6) and math.isclose(b, 8e-9, rel_tol=1e-6)
    a, b = fit_alpha_beta([(8, 1e-3), (1 << 20, 5e-4)])  # noisy: falling line
    assert a >= 0 and b >= 0
    with pytest.raises(ValueError):
        fit_alpha_beta([(1, 1.0)])


def test_link_model_json_round_trip():
    m = model()
    back = cm.LinkModel.from_json(m.to_json())
    assert back == m


def topo(nodes):
    return SimpleNamespace(nodes=nodes, links=model())


def test_choose_by_prediction_forced_modes_and_compression_rules():
    t = topo(((0, 1), (2, 3)))
    big, f32 = 64 * 2**20, torch.float32
    auto = choose("all_reduce", big, f32, t, load_config({}))
    assert auto.algorithm == "hier" and "predicted" in auto.reason and set(auto.candidates) == {"flat", "hier"}
    assert auto.predicted_seconds == min(auto.candidates.values())
    assert choose("all_reduce", big, f32, t, load_config({"MEMRT_COMM": "flat"})).algorithm == "flat"
    forced = choose("all_reduce", 8, f32, t, load_config({"MEMRT_COMM": "hier"}))
    assert forced.algorithm == "hier" and "MEMRT_COMM=hier" in forced.reason
    comp = choose("all_reduce", big, f32, t, load_config({}), compress="int8")
    assert comp.label == "hier+int8" and comp.codec == "int8"
    # integer tensors and MAX are never compressed; compression is off unless asked for
    assert choose("all_reduce", big, torch.int64, t, load_config({}), compress="int8").label == "hier"
    assert choose("all_reduce", big, f32, t, load_config({}), compress="int8",
                  reduce_op=torch.distributed.ReduceOp.MAX).label == "hier"
    assert "+" not in choose("all_reduce", big, torch.bfloat16, t, load_config({})).label
    # one node: flat, with the reason
    single = choose("all_reduce", big, f32, topo(((0, 1, 2, 3),)), load_config({}))
    assert single.algorithm == "flat" and "single node" in single.reason


def test_choice_crosses_over_with_size():
    """Tiny messages: flat (hier's measured per-call overhead dominates); large: hierarchical (less on the slow tier)."""
    t = SimpleNamespace(nodes=((0, 1, 2, 3), (4, 5, 6, 7)),
                        links=cm.LinkModel(intra=cm.TierLink(alpha_s=5e-6, beta_s_per_byte=1 / 5e9),
                                           inter=cm.TierLink(alpha_s=20e-6, beta_s_per_byte=1 / 125e6,
                                                             shared_beta_s_per_byte=4 / 125e6),
                                           call_overhead_s={"flat": 0.0, "hier": 1e-3}))
    assert choose("all_reduce", 64, torch.float32, t, None).algorithm == "flat"
    assert choose("all_reduce", 64 * 2**20, torch.float32, t, None).algorithm == "hier"


def test_each_op_uses_its_own_call_overhead():
    """An op's prediction takes its own measured overhead; a model probed without one takes all-reduce's."""

    nodes = ((0, 1), (2, 3))
    links = dict(intra=cm.TierLink(alpha_s=1e-3, beta_s_per_byte=1e-10), inter=cm.TierLink(alpha_s=1e-4, beta_s_per_byte=1e-8))
    bare = cm.LinkModel(**links)
    shared = cm.LinkModel(**links, call_overhead_s={"flat": 5e-3, "hier": 0.0})
    own = cm.LinkModel(**links, call_overhead_s={"flat": 5e-3, "hier": 0.0, "broadcast:flat": 2e-3,
                                              "broadcast:hier": -1e-4})
    n = 1 << 18
    assert cm.flat_broadcast(nodes, n, shared) == pytest.approx(cm.flat_broadcast(nodes, n, bare) + 5e-3)
    assert cm.flat_broadcast(nodes, n, own) == pytest.approx(cm.flat_broadcast(nodes, n, bare) + 2e-3)
    assert cm.hierarchical_broadcast(nodes, n, own) == pytest.approx(
        cm.hierarchical_broadcast(nodes, n, bare) - 1e-4)
    # other ops of the same model keep all-reduce's figure
    assert cm.flat_all_gather(nodes, n, own) == pytest.approx(cm.flat_all_gather(nodes, n, bare) + 5e-3)
    # the mid-size figure applies by size as for all-reduce
    mid = cm.LinkModel(**links, call_overhead_s={"reduce_scatter:hier": 1e-3}, mid_overhead_s={"reduce_scatter:hier": 3e-3})
    for size, extra in ((0, 1e-3), (1 << 19, 2e-3), (1 << 22, 3e-3)):
        assert cm.hierarchical_reduce_scatter(nodes, size, mid) == pytest.approx(
            cm.hierarchical_reduce_scatter(nodes, size, bare) + extra)


def test_tier_bytes_per_algorithm():
    nodes = ((0, 1), (2, 3))
    n = 2**20
    assert tier_bytes("hier", n, nodes, 0) == {"intra": n, "inter": n // 2}  # RS n/2 + AG n/2; shard n/2
    assert tier_bytes("hier", n, nodes, 0, codec="int8")["inter"] == n // 2 // 4
    assert tier_bytes("flat", n, nodes, 1) == {"inter": int(1.5 * n), "intra": 0}  # rank 1 -> 2 crosses
    assert predict("hier", n, nodes, model(), codec="bf16") < predict("hier", n, nodes, model())


def test_compressed_reduce_scatter_cost_and_bytes():
    """A compressed reduce-scatter sends the codec's share of the exact inter bytes and is predicted faster on
    a slow link, slower when encoding costs more than the link saves."""
    nodes = ((0, 1), (2, 3))
    n = 64 << 20
    exact = tier_bytes("hier", n, nodes, 0, op="reduce_scatter")
    assert exact == {"intra": n // 4 * 2, "inter": n // 4}
    assert tier_bytes("hier", n, nodes, 0, op="reduce_scatter", codec="int8") == {"intra": exact["intra"],
                                                                                   "inter": n // 16}
    assert tier_bytes("hier", n, nodes, 3, op="reduce_scatter", codec="bf16")["inter"] == n // 8
    t = {a: predict("hier", n, nodes, model(), op="reduce_scatter", codec=a.partition("+")[2] or None)
         for a in ("hier", "hier+bf16", "hier+int8")}
    assert t["hier+int8"] < t["hier+bf16"] < t["hier"], t
    slow_codec = model(inter_bw=100e9, shared_factor=1.0, codec=1e-8)
    assert predict("hier", n, nodes, slow_codec, op="reduce_scatter", codec="int8") > predict(
        "hier", n, nodes, slow_codec, op="reduce_scatter")
    from memrt.comm.select import choose

    topo = SimpleNamespace(nodes=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="no cost model"):
        predict("hier", n, nodes, model(), op="all_gather", codec="int8")
    assert choose("reduce_scatter", n, torch.float32, topo, model=model()).algorithm in ("flat", "hier")


def test_cache_key_and_path(tmp_path):
    k1 = topology_key(((0, 1), (2, 3)), ("cpu",) * 4, ["h1|10.0.0.1"] * 2 + ["h2|10.0.0.2"] * 2)
    k2 = topology_key(((0, 1), (2, 3)), ("cpu",) * 4, ["h1|10.0.0.1"] * 2 + ["h3|10.0.0.3"] * 2)
    k3 = topology_key(((0, 1, 2, 3),), ("cpu",) * 4, ["h1|10.0.0.1"] * 4)
    assert len({k1, k2, k3}) == 3
    assert cache_path(k1, tmp_path) == tmp_path / f"comm-links-{k1}.json"


def test_explain_rows_nccl_tests_bandwidths():
    from memrt.profiling.recorder import CommRecord

    recs = [CommRecord(op="all_reduce", dtype="float32", nbytes=2**20, group_size=4, algorithm="hier", seconds=0.01,
                       tier_bytes={"intra": 100, "inter": 50}, predicted_seconds=0.012) for _ in range(3)]
    recs.append(CommRecord(op="all_reduce", dtype="float32", nbytes=1000, group_size=4, algorithm="flat",
                           seconds=0.001))
    rows = explain_rows(recs)
    assert [(r.size_bucket_bytes, r.algorithm, r.calls) for r in rows] == [(1024, "flat", 1), (2**20, "hier", 3)]
    hier = rows[1]
    assert math.isclose(hier.algbw_bytes_per_s, 2**20 / 0.01)
    assert math.isclose(hier.busbw_bytes_per_s, hier.algbw_bytes_per_s * 2 * 3 / 4)
    assert hier.tier_bytes == {"intra": 300, "inter": 150} and math.isclose(hier.predicted_over_measured, 1.2)
    assert busbw_factor("all_gather", 4) == 0.75 and busbw_factor("broadcast", 4) == 1.0
    assert size_bucket(1025) == 2048
    text = explain(recs)
    assert "hier" in text and "busbw" in text and "PERFORMANCE.md" in text


@pytest.mark.slow
def test_memrt_bench_comm_runs_on_local_ranks(tmp_path):
    """`memrt bench comm --local 4` (two faked nodes): every algorithm timed per size, auto's choice explained."""
    import subprocess

    from memrt.testing import venv_bin

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([venv_bin("memrt"), "bench", "comm", "--local", "4", "--topology", "0,1;2,3",
                           "--sizes", "4KiB,1MiB", "--reps", "2", "--json", str(tmp_path / "bench.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for size in ("4.00 KiB", "1.00 MiB"):
        for algo in ("gloo", "flat", "hier", "hier+bf16", "hier+int8"):
            assert re.search(rf"^\s*{re.escape(size)}\s+{re.escape(algo)}\s+\d", proc.stdout, re.M), (size, algo)
    assert proc.stdout.count("auto -> ") == 2
    data = json.loads((tmp_path / "bench.json").read_text())
    assert sorted(int(n) for n in data["sizes"]) == [4096, 1 << 20]
