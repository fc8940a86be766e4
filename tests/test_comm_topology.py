"""Topology maths and formatting (no processes): grouping, uneven inter-node segments, table, JSON."""

from __future__ import annotations

from fractions import Fraction

import pytest

from memrt.comm.select import tier_bytes as select_tier_bytes
from memrt.launcher import first_host
from memrt.comm.topology import Topology, group_nodes, inter_segments


def test_group_nodes_orders_by_lowest_rank_and_allows_uneven():
    assert group_nodes(["b", "a", "b", "b"]) == ((0, 2, 3), (1,))
    assert group_nodes(["h"] * 3) == ((0, 1, 2),)


@pytest.mark.parametrize("sizes", [(2, 2), (3, 1), (3, 2), (4, 2, 3), (1, 1), (8, 5)])
def test_segments_cover_once_and_every_rank_owns_its_share(sizes):
    segs = inter_segments(sizes)
    assert segs[0].start == 0 and segs[-1].end == 1
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    assert len({s.owners for s in segs}) == len(segs)  # one group per segment
    for i, k in enumerate(sizes):
        for j in range(k):  # local rank j of node i owns exactly 1/k of the tensor: its node's share
            assert sum((s.end - s.start for s in segs if s.owners[i] == j), Fraction(0)) == Fraction(1, k)
    # element bounds agree with every node's even split, for any length (also shorter than the node)
    for length in (0, 1, 7, 1000003):
        for i, k in enumerate(sizes):
            for j in range(k):
                mine = [s.bounds(length) for s in segs if s.owners[i] == j]
                assert mine[0][0] == length * j // k and mine[-1][1] == length * (j + 1) // k


def test_uneven_nodes_have_no_single_root():
    topo = Topology.from_nodes(((0, 1, 2), (3,)), 0)
    assert topo.inter_groups() == ((0, 3), (1, 3), (2, 3))  # every rank of the big node crosses the link


def test_table_and_json_round_trip():
    topo = Topology.from_nodes(((0, 1, 2), (3,)), 1, device_kinds=("cpu", "cpu", "cpu", "cuda"),
                               hosts=("a|n1", "a|n1", "a|n1", "b|n2"), device_memory_bytes=(1, 2, 3, 4))
    text = str(topo)
    assert "0,1,2" in text and "cpu,cuda" not in text and "cuda" in text and "inter-node groups: 0,3; 1,3; 2,3" in text
    back = Topology.from_json(topo.to_json())
    assert back == topo and back.node_index == 0 and back.local_rank == 1 and not back.is_uniform


def test_bad_nodes_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="exactly once"):
        Topology.from_nodes(((0, 1), (1, 2)), 0)
    with pytest.raises(ValueError, match="not in nodes"):
        Topology.from_nodes(((0, 1),), 5)


def test_forced_device_kind(monkeypatch):
    from memrt.comm.topology import _device_kind

    monkeypatch.setenv("MEMRT_FORCE_DEVICE_KIND", "1=cuda,0=cpu")
    assert _device_kind(1) == "cuda" and _device_kind(0) == "cpu"


def test_slurm_first_host():
    assert first_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_host("nodeA,nodeB") == "nodeA"
    assert first_host("n[1-2]") == "n1"


def tiers_on(topo, op, algorithm, nbytes):
    """Bytes per tier as memrt.comm records them for a call on ``topo`` (its nodes and rank)."""
    return select_tier_bytes(algorithm, nbytes, topo.nodes, topo.rank, op=op)


def test_tier_bytes_hier_sends_less_across_nodes_than_the_flat_ring():
    topo = Topology.from_nodes(((0, 1), (2, 3)), 1)  # rank 1's ring neighbour is on the other node
    n = 64 << 20
    flat, hier = tiers_on(topo, "all_reduce", "flat", n), tiers_on(topo, "all_reduce", "hier", n)
    assert flat == {"intra": 0, "inter": int(1.5 * n)}
    assert hier == {"intra": n, "inter": n // 2}  # RS n/2 + AG n/2 inside the node; n/2 across


# ---------------------------------------------------------------- bytes per tier, any layout
def _ring_truth(nodes, rank, sent):
    """Flat ring in rank order: rank r sends ``sent`` bytes to r+1 (mod p); inter when that is another node."""
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    p = len(node_of)
    return {"inter": sent, "intra": 0} if node_of[(rank + 1) % p] != node_of[rank] else {"intra": sent, "inter": 0}


LAYOUTS = [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2)), ((0, 1, 2), (3,)), ((1, 3, 4), (0, 2)),
           ((0, 4), (1, 2, 5), (3,))]


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_tier_bytes_is_right_for_any_rank_to_node_layout(nodes):
    from memrt.comm import select

    n = 12 * 2**20
    p = sum(len(x) for x in nodes)
    m = len(nodes)
    for rank in range(p):
        topo = Topology.from_nodes(nodes, rank)
        for op, sent in (("all_reduce", int(2 * (p - 1) / p * n)), ("all_gather", (p - 1) * n),
                         ("reduce_scatter", int((p - 1) / p * n)), ("broadcast", n)):
            want = _ring_truth(nodes, rank, sent)
            assert select.tier_bytes("flat", n, nodes, rank, op=op) == want, (op, rank)
            assert tiers_on(topo, op, "flat", n) == want, (op, rank)  # the Topology's view is the same
        k = len(next(x for x in nodes if rank in x))
        hier = select.tier_bytes("hier", n, nodes, rank)
        assert hier == tiers_on(topo, "all_reduce", "hier", n)
        assert hier["intra"] == (int(2 * (k - 1) / k * n) if k > 1 else 0)
    # hierarchical all-reduce: every node pushes the same 2(m-1)/m n across the cut, whatever its size
    # (each of its k ranks carries 1/k of the node's share: no single root)
    for node in nodes:
        pushed = sum(select.tier_bytes("hier", n, nodes, r)["inter"] for r in node)
        assert abs(pushed - 2 * (m - 1) / m * n) <= len(node), (node, pushed)


def test_tier_bytes_rejects_a_rank_outside_the_nodes():
    from memrt.comm import select

    with pytest.raises(ValueError, match="rank=7"):
        select.tier_bytes("flat", 8, ((0, 1), (2, 3)), 7)


# ---------------------------------------------------------------- one cost-model choice for every op
def _links(shared: float, *, gamma: float = 1 / 1e9, hier_overhead: float = 0.0, inter_bps: float = 125e6,
           intra_bps: float = 5e9):
    from memrt.comm import costmodel as cm

    return cm.LinkModel(intra=cm.TierLink(alpha_s=5e-6, beta_s_per_byte=1 / intra_bps),
                        inter=cm.TierLink(alpha_s=50e-6, beta_s_per_byte=1 / inter_bps,
                                          shared_beta_s_per_byte=shared / inter_bps),
                        gamma_s_per_byte=gamma, call_overhead_s={"flat": 0.0, "hier": hier_overhead})


def _choose(op, nbytes, nodes, links, **cfg):
    from types import SimpleNamespace

    import torch

    from memrt.comm.select import choose
    from memrt.config import load_config

    return choose(op, nbytes, torch.float32, SimpleNamespace(nodes=nodes, links=links), load_config(cfg))


def test_fast_link_slow_copies_hier_for_all_reduce_flat_for_all_gather_at_256mib():
    """2 nodes x 2 ranks, 8 Gbit/s between nodes, 2 GB/s inside a node, local copies at 1 GB/s (a CPU-bound
    cluster, like the 10 Gbit/s emulated run in docs/sections/benchmarks.md where hierarchical all-reduce
    was 1.29x gloo and hierarchical all-gather 0.42x): all-reduce still gains from sending half the bytes
    across, all-gather's hierarchical path (the same bytes across plus a gather inside and a copy into
    rank order per byte) does not. With a slow (1 Gbit/s) link hierarchical wins for every op."""
    nodes, big = ((0, 1), (2, 3)), 256 * 2**20
    fast = _links(1.0, inter_bps=1e9, intra_bps=2e9, gamma=1 / 1e9)
    ar = _choose("all_reduce", big, nodes, fast)
    ag = _choose("all_gather", big // 4, nodes, fast)  # 256 MiB gathered
    assert ar.algorithm == "hier" and ar.candidates["hier"] < 0.9 * ar.candidates["flat"], ar.reason
    assert ag.algorithm == "flat" and ag.candidates["flat"] < 0.9 * ag.candidates["hier"], ag.reason
    slow = _links(2.0, gamma=1 / 1e9)  # 1 Gbit/s, two flows share it fairly
    for op, n in (("all_reduce", big), ("all_gather", big // 4), ("reduce_scatter", big), ("broadcast", big)):
        d = _choose(op, n, nodes, slow)
        assert d.algorithm == "hier" and d.predicted_seconds == min(d.candidates.values()), (op, d.reason)


def test_broadcast_cost_counts_flows_sharing_a_link():
    """gloo's tree from rank 0 on 0,1;2,3: round 1 stays in node 0, round 2 sends 0->2 and 1->3 at once:
    two flows on one link, twice one flow's time (as measured: gloo 4.5 s, memrt's hier 2.25 s at 256 MiB,
    1 Gbit/s, docs/sections/benchmarks.md)."""
    from memrt.comm import costmodel as cm

    assert cm._tree_rounds(((0, 1), (2, 3)), 0) == [0, 2]
    assert cm._tree_rounds(((0, 2), (1, 3)), 0) == [1, 0]
    links, n = _links(2.0), 256 * 2**20
    flat, hier = cm.flat_broadcast(((0, 1), (2, 3)), n, links), cm.hierarchical_broadcast(((0, 1), (2, 3)),
                                                                                                 n, links)
    assert 1.9 < flat / hier < 2.1


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_every_op_chooses_by_predicted_time_forced_modes_and_fallbacks(op):
    nodes = ((0, 1), (2, 3))
    links = _links(2.0, gamma=1 / 4e9, hier_overhead=2e-3)  # hier pays 2 ms per call (threads, staging)
    small, big = _choose(op, 1024, nodes, links), _choose(op, 64 * 2**20, nodes, links)
    assert small.algorithm == "flat" and big.algorithm == "hier", (small.reason, big.reason)
    for d in (small, big):
        assert set(d.candidates) == {"flat", "hier"} and d.predicted_seconds == min(d.candidates.values())
        assert d.reason.startswith(f"auto: {op}")
    assert _choose(op, 64 * 2**20, nodes, links, MEMRT_COMM="flat").algorithm == "flat"
    assert _choose(op, 1024, nodes, links, MEMRT_COMM="hier").algorithm == "hier"
    assert _choose(op, 64 * 2**20, ((0, 1, 2, 3),), links).algorithm == "flat"  # one node
    uneven = _choose(op, 64 * 2**20, ((0, 1, 2), (3,)), links, MEMRT_COMM="hier")
    if op in ("all_gather", "reduce_scatter"):  # hierarchical on equal nodes only
        assert uneven.algorithm == "flat" and "equal nodes" in uneven.reason
    else:
        assert uneven.algorithm == "hier"


def test_gloo_reduce_scatter_costs_a_whole_all_reduce():
    """gloo runs reduce_scatter_tensor as an all-reduce of the whole input; other backends as a ring reduce-scatter."""
    from memrt.comm import costmodel as cm

    nodes, links, n = ((0, 1), (2, 3)), _links(2.0), 64 * 2**20
    assert cm.flat_reduce_scatter(nodes, n, links, backend="gloo") == cm.flat_all_reduce(nodes, n, links)
    assert cm.flat_reduce_scatter(nodes, n, links, backend="nccl") < cm.flat_all_reduce(nodes, n, links)
