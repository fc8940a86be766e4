"""Shared fixtures and markers: gpu tests skip without CUDA, root tests without root, mpi without mpiexec;
``alone`` tests run with no other test beside them when the suite runs on several workers (``pytest -n``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

import pytest

from memrt.testing import venv_bin


_INDUCTOR_CACHE: str | None = None
_TURN_DIR: str | None = None
# the lock file that keeps ``alone`` tests apart from every other test; set by the session's first process
# (xdist's controller, or the only process) and inherited by the workers it starts
_TURN_LOCK = "PYTEST_MEMRT_TURN_LOCK"  # not MEMRT_*: the processes tests start inherit it


def pytest_configure(config):
    """One inductor cache for the session (empty at its start, as on a fresh machine): the processes the
    tests start inherit it, so a graph compiled by one test is not compiled again by the next. The
    workers of ``pytest -n`` inherit it too, with the lock file of :func:`_turn`."""
    global _INDUCTOR_CACHE, _TURN_DIR
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="memrt-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    if _TURN_LOCK not in os.environ:
        _TURN_DIR = tempfile.mkdtemp(prefix="memrt-tests-turn-")
        os.environ[_TURN_LOCK] = os.path.join(_TURN_DIR, "turn.lock")


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
    if _TURN_DIR is not None:
        os.environ.pop(_TURN_LOCK, None)
        shutil.rmtree(_TURN_DIR, ignore_errors=True)


@contextlib.contextmanager
def _turn(alone: bool):
    """Hold the session's lock for one test: shared for most, exclusive for an ``alone`` test (it measures
    time, CPU shares or links, so nothing else may run beside it). A waiting exclusive holder goes first:
    every holder passes a gate, which the exclusive one keeps closed while it waits."""
    path = os.environ.get(_TURN_LOCK)
    if path is None or not os.path.isdir(os.path.dirname(path)):
        yield
        return
    with open(path + ".gate", "a") as gate, open(path, "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up, call and tear-down of each test (module fixtures included) inside its turn; root tests run
    alone too (network namespaces, shaped links and cgroup quotas are the whole machine's)."""
    with _turn("alone" in item.keywords or "root" in item.keywords):
        yield


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
