"""Unchanged torchrun scripts under mpiexec / srun: the rendezvous address torch's ``env://`` needs.

At start-up :mod:`memrt.activation.autoload` filled ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the
launcher's variables; here, when the script calls ``init_process_group`` without an address (no
``init_method``, no ``store``, no ``MASTER_ADDR``), one is supplied as ``MASTER_ADDR``/``MASTER_PORT``:

- MPI launchers: rank 0's address and a free port, agreed over mpi4py (:func:`memrt.launcher.mpi_rendezvous`);
- srun: the first host of the step's node list and a port derived from the job id (every rank computes
  the same values without talking to the others: :func:`memrt.launcher.slurm_master`).
"""

from __future__ import annotations

import os
from typing import Any

from memrt.activation import session
from memrt.errors import ConfigError
from memrt.launcher import master_address

__all__ = ["rendezvous_kwargs"]


def rendezvous_kwargs(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for init_process_group, after making an env:// rendezvous possible under MPI or srun."""
    launch = session.launch_info()
    if not (launch.is_mpi or launch.launcher == "slurm") or launch.world_size <= 1:
        return kwargs
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if kwargs.get("store") is not None or init_method not in (None, "env://"):
        return kwargs
    try:
        found = master_address(launch)
    except ConfigError:
        return kwargs  # torch's own error will name MASTER_ADDR
    if found is not None:
        os.environ["MASTER_ADDR"] = found[0]  # writes for torch's env:// reader; memrt reads through memrt.config
        os.environ["MASTER_PORT"] = str(found[1])
    return kwargs
