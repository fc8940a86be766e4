"""Child of test_comm_mpi (run under ``mpiexec -n 4``): memrt's MPI backend vs torch.distributed and the reference.

MEMRT_TOPOLOGY="0,1;2,3": ``init_process_group(backend="mpi")`` (no MASTER_ADDR: rendezvous over
mpi4py), then every case through memrt.comm.all_reduce (hierarchical over MPI tiers), through
MPIBackend with the uneven topology "0,1,2;3" and flat (ordered over COMM_WORLD), and through the
mixed tiers (MPI inside a node, gloo across). Prints FAIL lines; exits 1 on any failure.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as tdist  # noqa: E402

import memrt.comm as dist  # noqa: E402
from _comm_cases import DTYPES, MIB64, OPS, compare, make_input, reference  # noqa: E402
from memrt.comm import hierarchical  # noqa: E402
from memrt.comm.mpi_backend import MPIBackend, mixed_groups  # noqa: E402
from memrt.comm.topology import Topology  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group(backend="mpi")
rank, world = dist.get_rank(), dist.get_world_size()
topo = dist.get_topology()
uneven = MPIBackend(topology=Topology.from_nodes(((0, 1, 2), (3,)), rank))
mixed = mixed_groups(topo)
fails = []


def check(tag, mine, ref, theirs, dtype):
    compare(tag, mine, ref, theirs, dtype, fails)


cases = [(n, d, op) for n in (1, 7, 1000003) for d in DTYPES for op in OPS] + [(MIB64 // 4, torch.float32, "SUM")]
for numel, dtype, op in cases:
    if op == "AVG" and not dtype.is_floating_point:
        continue
    x = make_input(rank, numel, dtype, op)
    theirs = x.clone()
    tdist.all_reduce(theirs, op=getattr(tdist.ReduceOp, op))
    inputs = [make_input(r, numel, dtype, op) for r in range(world)]
    tag = f"{numel} {dtype} {op}"
    a = x.clone()
    dist.all_reduce(a, op=getattr(dist.ReduceOp, op))
    check(f"{tag} mpi hier {topo.nodes}", a, reference(inputs, topo.nodes, op), theirs, dtype)
    if numel <= 1000003:
        b = x.clone()
        uneven.all_reduce(b, op, algorithm="hier", chunk_bytes=256 * 1024)
        check(f"{tag} mpi hier uneven", b, reference(inputs, ((0, 1, 2), (3,)), op), theirs, dtype)
    if numel < 1000003 or (dtype == torch.bfloat16 and op in ("SUM", "MAX")):
        c = x.clone()
        uneven.all_reduce(c, op, algorithm="flat")
        check(f"{tag} mpi flat", c, reference(inputs, ((0, 1, 2, 3),), op), theirs, dtype)
        d = x.clone()
        hierarchical.hierarchical_all_reduce(d, op, topo, groups=mixed, chunk_bytes=256 * 1024)
        check(f"{tag} mpi intra + gloo inter", d, reference(inputs, topo.nodes, op), theirs, dtype)

from memrt.profiling.recorder import get_recorder  # noqa: E402

if not any(r.algorithm == "hier@mpi" for r in get_recorder().comm):
    fails.append("no CommRecord with algorithm hier@mpi")
for f in fails:
    print(f"FAIL rank {rank}: {f}", flush=True)
print(f"rank {rank}: {len(cases)} cases, {len(fails)} failures", flush=True)
uneven.close()
dist.destroy_process_group()
sys.exit(1 if fails else 0)
