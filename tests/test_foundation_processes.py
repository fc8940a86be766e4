"""Test infrastructure itself: gloo processes, the MPI rendezvous, the emulated cluster."""

import re
import textwrap

import pytest

from memrt.testing import ProcessFailure, run_mpi, run_processes


def _sum_ranks(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


@pytest.mark.slow
def test_run_processes_gloo():
    assert run_processes(_sum_ranks, 3) == [6.0, 6.0, 6.0]


@pytest.mark.slow
def test_run_processes_names_the_failing_rank():
    with pytest.raises(ProcessFailure, match="rank 1 failed.*boom from rank 1"):
        run_processes(_fail_on_one, 2, init_process_group=False)


MPI_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from memrt.launcher import discover_launch, mpi_rendezvous
    info = discover_launch()
    assert info.is_mpi, info
    url = mpi_rendezvous("127.0.0.1")
    dist.init_process_group("gloo", init_method=url, rank=info.rank, world_size=info.world_size)
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    print(f"rank {info.rank} launcher {info.launcher} sum {t.item()}")
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.mpi
def test_mpiexec_rendezvous_reaches_gloo_group():
    proc = run_mpi(["python", "-c", MPI_SCRIPT], 2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("sum 3.0") == 2 and "launcher mpich" in proc.stdout


@pytest.mark.slow
@pytest.mark.root
def test_emulated_cluster_rate_within_20_percent(emulated_cluster):
    measured = emulated_cluster.measure_rate(seconds=2.0)
    assert abs(measured - 1e9) / 1e9 < 0.20, measured


MPI_CLUSTER_SCRIPT = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    w = MPI.COMM_WORLD
    node = w.Split_type(MPI.COMM_TYPE_SHARED)
    x = np.full(1 << 20, w.Get_rank() + 1, dtype=np.float32)
    w.Allreduce(MPI.IN_PLACE, x)
    print(f"rank {w.Get_rank()} node_size {node.Get_size()} sum {x[0]} min {x.min()}", flush=True)
    w.Barrier()
    t0 = MPI.Wtime()
    for _ in range(3):
        w.Allreduce(MPI.IN_PLACE, x)
    t = w.allreduce((MPI.Wtime() - t0) / 3, op=MPI.MAX)
    if w.Get_rank() == 0:
        print(f"seconds {t:.6f}", flush=True)
""")


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.mpi
def test_mpich_ranks_span_the_emulated_nodes(emulated_cluster, tmp_path):
    """mpiexec through EmulatedCluster.mpiexec_command: MPICH sees two nodes of two ranks, and the
    all-reduce is right (so its traffic between the nodes crossed the veth: nothing else joins them)."""
    import subprocess

    from memrt.testing import venv_bin

    mpiexec = venv_bin("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    cmd = emulated_cluster.mpiexec_command(mpiexec, 2, ["python", "-c", MPI_CLUSTER_SCRIPT], str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Hydra forwards the ranks' output as it comes: lines may run together
    lines = sorted(re.findall(r"rank \d+ node_size \d+ sum [\d.]+ min [\d.]+", proc.stdout))
    assert lines == [f"rank {r} node_size 2 sum 10.0 min 10.0" for r in range(4)], proc.stdout + proc.stderr[-2000:]
    # an all-reduce of S bytes must move S bytes across the cut each way: at 1 Gbit/s that takes S * 8 / 1e9 s
    # at least, unless MPICH found a way around the link (shared memory: what UCX does by default on one host)
    seconds = float(re.search(r"seconds ([\d.]+)", proc.stdout).group(1))
    bound = (4 << 20) * 8 / 1e9
    assert seconds >= 0.8 * bound, (seconds, bound)
