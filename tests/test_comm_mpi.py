"""The MPI backend under ``mpiexec -n 4``: same results as torch.distributed / the reference order."""

from __future__ import annotations

from pathlib import Path

import pytest

from memrt.testing import run_mpi

HERE = Path(__file__).parent


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mpi_backend_every_op_dtype_and_size():
    # 4 MPICH ranks on 2 cores busy-poll each other: usually ~50 s, once seen at ~5 min on an idle machine.
    proc = run_mpi(["python", str(HERE / "_comm_mpi_child.py")], 4, timeout=800,
                   env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier", "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert out.count("0 failures") == 4, out[-5000:]


def test_missing_mpi4py_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **kw):
        if name.startswith("mpi4py"):
            raise ImportError("No module named 'mpi4py'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    from memrt.comm import mpi_backend

    with pytest.raises(ImportError, match=r'pip install "memrt\[mpi\]"'):
        mpi_backend.MPIBackend()
