"""Helpers to run code in real processes, used by memrt's tests and benchmarks."""

from memrt.testing.distributed import ProcessFailure, run_mpi, run_processes, venv_bin

__all__ = ["ProcessFailure", "run_mpi", "run_processes", "venv_bin"]
