"""Unchanged torchrun scripts under mpiexec: the rendezvous address torch's ``env://`` needs.

At start-up :mod:`memrt.activation.autoload` filled ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the MPI
launcher's variables; here, when the script calls ``init_process_group`` without an address (no
``init_method``, no ``store``, no ``MASTER_ADDR``), rank 0's address and a free port are agreed over
mpi4py (:func:`memrt.launcher.mpi_rendezvous`) and handed to torch as ``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from memrt.activation import session
from memrt.config import environ
from memrt.launcher import mpi_rendezvous

__all__ = ["rendezvous_kwargs"]


def rendezvous_kwargs(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for init_process_group, after making an env:// rendezvous possible under MPI."""
    if not session.launch_info().is_mpi:
        return kwargs
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if kwargs.get("store") is not None or init_method not in (None, "env://"):
        return kwargs
    env = environ()
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return kwargs
    url = urlparse(mpi_rendezvous())
    os.environ["MASTER_ADDR"] = url.hostname or "127.0.0.1"  # a write for torch's env:// reader
    os.environ["MASTER_PORT"] = str(url.port)
    return kwargs
