"""The harness that runs memrt's tests and benchmarks: rank launchers, test models, the model zoo."""

from memrt.testing.launch import ProcessFailure, launch_ranks, run_mpi, run_on_cluster, run_processes, venv_bin

__all__ = ["ProcessFailure", "launch_ranks", "run_mpi", "run_on_cluster", "run_processes", "venv_bin"]
