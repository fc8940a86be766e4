"""Topology maths and formatting (no processes): grouping, uneven inter-node segments, table, JSON."""

from __future__ import annotations

from fractions import Fraction

import pytest

from memrt.comm.api import first_host, tier_bytes
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


def test_tier_bytes_hier_sends_less_across_nodes_than_the_flat_ring():
    topo = Topology.from_nodes(((0, 1), (2, 3)), 1)  # rank 1's ring neighbour is on the other node
    n = 64 << 20
    flat, hier = tier_bytes("all_reduce", "flat", n, topo), tier_bytes("all_reduce", "hier", n, topo)
    assert flat == {"intra": 0, "inter": int(1.5 * n)}
    assert hier == {"intra": n, "inter": n // 2}  # RS n/2 + AG n/2 inside the node; n/2 across
