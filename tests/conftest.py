"""Shared fixtures and markers: gpu tests skip without CUDA, root tests without root, mpi without mpiexec."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from memrt.testing import venv_bin


_INDUCTOR_CACHE: str | None = None


def pytest_configure(config):
    """One inductor cache for the session (empty at its start, as on a fresh machine): the processes the
    tests start inherit it, so a graph compiled by one test is not compiled again by the next."""
    global _INDUCTOR_CACHE
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="memrt-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import torch

    has_gpu = torch.cuda.is_available()
    is_root = os.geteuid() == 0
    has_mpi = venv_bin("mpiexec") is not None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        has_mpi = False
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "root" in item.keywords and not is_root:
            item.add_marker(pytest.mark.skip(reason="needs root (network namespaces / cgroups)"))
        if "mpi" in item.keywords and not has_mpi:
            item.add_marker(pytest.mark.skip(reason="needs mpiexec and mpi4py: pip install mpi4py mpich"))


@pytest.fixture
def emulated_cluster():
    """A two-namespace cluster at 1 Gbit/s (tests using it carry the root marker)."""
    from memrt.cluster import EmulatedCluster, can_emulate

    ok, why = can_emulate()
    if not ok:
        pytest.skip(why)
    with EmulatedCluster("1gbit") as cluster:
        yield cluster


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: threads spin against each other on a loaded 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
