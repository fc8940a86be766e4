"""memrt.comm.all_reduce (hierarchical, pipelined) vs torch.distributed and the documented reference order.

4 real processes on loopback (gloo). Nodes are faked: MEMRT_TOPOLOGY="0,1,2;3" (uneven) for the public
``memrt.comm.all_reduce`` path, and ``"0,1;2,3"`` given to ``hierarchical_all_reduce`` directly in the
same processes (one process group for every case keeps the test fast). Integers must equal
torch.distributed's all_reduce bit for bit; floats must equal the reference order of
tests/_comm_cases.py bit for bit (and be close to torch's, whose ring order differs).
"""

from __future__ import annotations

import pytest
import torch

from memrt.testing import run_processes

from _comm_cases import DTYPES, MIB64, OPS, compare, make_input, reference

SMALL_SIZES = (1, 7, 1000003)




def _check_cases(rank: int, world: int, cases: list[tuple[int, str, str]], other_nodes, chunk_bytes: int) -> list[str]:
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm import hierarchical
    from memrt.comm.topology import Topology

    dist.setup_topology()
    topo = dist.get_topology()
    other = Topology.from_nodes(other_nodes, rank)
    failures = []
    from memrt.comm.setup import STATE
    from memrt.comm.tiers import torch_groups

    # the public path uses the shared-memory intra tier (same host); the direct one the gloo tiers
    direct_groups = torch_groups(other)  # collective: every rank creates the groups
    if (topo.local_size > 1 and STATE.groups.intra_shm is None) or direct_groups.intra_shm is not None:
        failures.append("expected the shared-memory tier on the public path and gloo tiers on the direct one")
    for i, (numel, dtname, op) in enumerate(cases):
        dtype = getattr(torch, dtname)
        x = make_input(rank, numel, dtype, op)
        if op == "AVG" and not dtype.is_floating_point:
            try:
                dist.all_reduce(x.clone(), op=dist.ReduceOp.AVG)
                failures.append(f"{numel} {dtname} AVG: no error")
            except TypeError:
                pass
            continue
        theirs = x.clone()
        tdist.all_reduce(theirs, op=getattr(tdist.ReduceOp, op))
        inputs = [make_input(r, numel, dtype, op) for r in range(world)]
        # public path, MEMRT_TOPOLOGY nodes; every other case async
        mine = x.clone()
        work = dist.all_reduce(mine, op=getattr(dist.ReduceOp, op), async_op=bool(i % 2))
        if work is not None:
            work.wait()
        compare(f"{numel} {dtname} {op} nodes={topo.nodes}", mine, reference(inputs, topo.nodes, op), theirs, dtype,
                 failures)
        # direct call, the other topology, small chunks so the pipeline runs over many chunks
        mine = x.clone()
        hierarchical.hierarchical_all_reduce(mine, op, other, chunk_bytes=chunk_bytes)
        compare(f"{numel} {dtname} {op} nodes={other.nodes}", mine, reference(inputs, other.nodes, op), theirs,
                 dtype, failures)
    # hierarchical broadcast on the (uneven) public topology, from every node position
    for numel, src in ((7, 0), (1000003, 2), (1000003, 3)):
        a = make_input(rank, numel, torch.float32, "SUM")
        b = a.clone()
        dist.broadcast(a, src=src)
        tdist.broadcast(b, src=src)
        if not torch.equal(a, b):
            failures.append(f"broadcast {numel} from {src} nodes={topo.nodes}")
    return failures


def _all_cases():
    return [(n, str(d).replace("torch.", ""), op) for n in SMALL_SIZES for d in DTYPES for op in OPS]


@pytest.mark.slow
def test_every_op_dtype_and_size_on_even_and_uneven_nodes():
    cases = _all_cases() + [(MIB64 // 4, "float32", "SUM")]
    out = run_processes(_check_cases, 4, cases, ((0, 1), (2, 3)), 256 * 1024,
                        env={"MEMRT_TOPOLOGY": "0,1,2;3", "MEMRT_COMM": "hier"}, timeout=300)
    assert out == [[]] * 4, "\n".join(out[0])


def _layouts(rank: int, world: int) -> list[str]:
    """Every hierarchical collective on nodes whose members are not in ascending rank order (torch numbers a
    group's members by rank): results equal torch.distributed's (integer-valued floats: any order is exact)."""
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm import hierarchical
    from memrt.comm.topology import Topology
    from memrt.comm.tiers import torch_groups
    from memrt.profiling.recorder import get_recorder

    dist.setup_topology()
    failures: list[str] = []
    n = 30011
    x = torch.randint(-50, 50, (world * n,), generator=torch.Generator().manual_seed(rank)).float()
    want_ar = x.clone()
    tdist.all_reduce(want_ar)
    want_ag = torch.empty(world * x.numel())
    tdist.all_gather_into_tensor(want_ag, x)
    want_rs = torch.empty(n)
    tdist.reduce_scatter_tensor(want_rs, x.clone())
    rec = get_recorder()
    rec.clear()
    got = x.clone()
    dist.all_reduce(got)
    if not torch.equal(got, want_ar):
        failures.append("all_reduce")
    got = torch.empty_like(want_ag)
    dist.all_gather_into_tensor(got, x)
    if not torch.equal(got, want_ag):
        failures.append("all_gather")
    for compress in (None, "bf16"):
        got = torch.empty(n)
        dist.reduce_scatter_tensor(got, x.clone(), compress=compress)
        if not torch.equal(got, want_rs):
            failures.append(f"reduce_scatter compress={compress}")
    for src in range(world):
        a, b = x.clone(), x.clone()
        dist.broadcast(a, src=src)
        tdist.broadcast(b, src=src)
        if not torch.equal(a, b):
            failures.append(f"broadcast from {src}")
    if {r.algorithm.split("+")[0] for r in rec.comm} != {"hier"}:
        failures.append(f"not all hierarchical: {sorted({r.algorithm for r in rec.comm})}")
    # the same algorithms called directly on nodes listed in descending order inside each node
    other = Topology.from_nodes(((1, 0), (3, 2)), rank)
    groups = torch_groups(other, shm=False)
    got = x.clone()
    hierarchical.hierarchical_all_reduce(got, "SUM", other, groups=groups, chunk_bytes=64 * 1024)
    if not torch.equal(got, want_ar):
        failures.append("direct all_reduce nodes=((1,0),(3,2))")
    got = torch.empty_like(want_ag)
    hierarchical.hierarchical_all_gather(got, x, other, groups=groups, chunk_bytes=64 * 1024)
    if not torch.equal(got, want_ag):
        failures.append("direct all_gather nodes=((1,0),(3,2))")
    got = torch.empty(n)
    hierarchical.hierarchical_reduce_scatter(got, x.clone(), "SUM", other, groups=groups, chunk_bytes=64 * 1024)
    if not torch.equal(got, want_rs):
        failures.append("direct reduce_scatter nodes=((1,0),(3,2))")
    return failures


@pytest.mark.slow
def test_nodes_whose_members_are_not_in_rank_order():
    """Hosts A, B, B, A give nodes (0, 3) and (1, 2): the slot tier of local rank 1 is (3, 2) in node order."""
    out = run_processes(_layouts, 4, env={"MEMRT_TOPOLOGY": "0,3;1,2", "MEMRT_COMM": "hier"}, timeout=300)
    assert out == [[]] * 4, out
