import pytest

from memrt.errors import ConfigError
from memrt.launcher import discover_launch

CASES = [
    ("torchrun", {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}, (3, 8, 1, 2)),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (5, 6, 2, 3)),
    ("mvapich", {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
                 "MV2_COMM_WORLD_LOCAL_SIZE": "1"}, (1, 2, 0, 1)),
    ("mpich", {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 4, 0, 2)),
    ("slurm", {"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"},
     (7, 8, 3, 4)),
    ("slurm", {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
               "SLURM_TASKS_PER_NODE": "4,1"}, (4, 5, 0, 1)),
    ("slurm", {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
               "SLURM_TASKS_PER_NODE": "2(x3)"}, (5, 6, 1, 2)),
    ("single", {}, (0, 1, 0, 1)),
]


@pytest.mark.parametrize("launcher,env,expected", CASES)
def test_launcher_matrix(launcher, env, expected):
    info = discover_launch(env)
    assert info.launcher == launcher
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == expected


def test_torchrun_inside_slurm_allocation_resolves_to_torchrun():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
           "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    info = discover_launch(env)
    assert info.launcher == "torchrun" and (info.rank, info.world_size, info.local_world_size) == (2, 4, 2)


def test_sources_are_never_mixed():
    # Open MPI's rank with torchrun's local values absent: local values come from Open MPI only.
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "7"}
    info = discover_launch(env)
    assert info.launcher == "openmpi" and info.local_rank == 1 and info.local_world_size == 2


@pytest.mark.parametrize("env,var", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
    ({"PMI_RANK": "0", "PMI_SIZE": "-1"}, "PMI_SIZE"),
])
def test_bad_launcher_values(env, var):
    with pytest.raises(ConfigError, match=var):
        discover_launch(env)


def test_attempt_prefix_names_torchrun_restarts_only():
    from memrt.launcher import attempt_prefix

    assert attempt_prefix({}) == "" and attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "0"}) == ""
    assert attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}) == "attempt2/"


def test_memrt_group_keys_move_with_the_attempt(monkeypatch):
    """A restarted attempt's gloo keys are not the dead attempt's (torchrun keeps one store across restarts)."""
    import torch.distributed as dist

    from memrt.comm.backend import _device_store

    store = dist.HashStore()
    group_store = dist.PrefixStore("cpu/", dist.PrefixStore("0/", store))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _device_store(group_store, "cpu").set("k", "first")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = _device_store(group_store, "cpu")
    assert not second.check(["k"])  # the first attempt's key is not visible to the second
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert _device_store(group_store, "cpu").check(["k"])  # while the first attempt's own ranks see it
