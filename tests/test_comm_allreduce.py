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
