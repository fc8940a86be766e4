"""Test infrastructure itself: gloo processes, the MPI rendezvous, the emulated cluster."""

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
