"""Start-up of env activation: what the ``.pth`` line calls when ``MEMRT`` is on.

It imports no torch and does no work beyond deciding whether this interpreter is a training process:

- the torchrun / ``torch.distributed.run`` agent, multiprocessing children (DataLoader workers, spawn and
  forkserver helpers), torch compile workers, and any process started by an already-activated rank
  (``MEMRT_AUTOLOAD_ACTIVE`` holds another pid) stay untouched;
- otherwise a post-import hook is registered (:func:`memrt.activation.hooks.install`); everything else
  happens when the job calls ``init_process_group``, builds a ``DistributedDataParallel`` or calls
  ``fully_shard``.

Under an MPI launcher (mpiexec / mpirun) the torchrun variables the script may read (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) are filled in from the MPI ones, so unchanged
torchrun scripts run under ``mpiexec -n N`` too; the rendezvous address follows in ``init_process_group``.

A failure here prints one warning and leaves the process as if memrt were off (``MEMRT_STRICT=1``: raise).
"""

from __future__ import annotations

import os
import sys

__all__ = ["start", "excluded_reason"]

_STARTED = False

_AGENT_SCRIPTS = ("torchrun", "torchrun.exe")
_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_AGENT_FILES = (os.path.join("torch", "distributed", "run.py"), os.path.join("torch", "distributed", "launch.py"))
_MP_MARKERS = ("--multiprocessing-fork", "multiprocessing.spawn", "multiprocessing.forkserver",
               "multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker")
_COMPILE_MARKERS = ("torch._inductor", "compile_worker", "torch._dynamo")


def excluded_reason(argv: list[str] | None = None, orig_argv: list[str] | None = None,
                    active_pid: str | None = None, pid: int | None = None) -> str | None:
    """Why this process must stay untouched, or None when it may be a training process."""
    argv = list(sys.argv if argv is None else argv)
    orig = list(getattr(sys, "orig_argv", argv) if orig_argv is None else orig_argv)
    pid = os.getpid() if pid is None else pid
    script = argv[0] if argv else ""
    if os.path.basename(script) in _AGENT_SCRIPTS or script.endswith(_AGENT_FILES):
        return "torchrun agent"
    for i, arg in enumerate(orig[:-1]):
        if arg == "-m" and orig[i + 1] in _AGENT_MODULES:
            return "torchrun agent"
    if any(m in a for a in orig for m in _MP_MARKERS):
        return "multiprocessing child"
    if any(m in a for a in orig for m in _COMPILE_MARKERS):
        return "compile worker"
    if active_pid and active_pid != str(pid):
        return f"child of activated process {active_pid}"
    return None


def _fill_torchrun_variables() -> None:
    """Under mpiexec/mpirun/srun, give the script torchrun's RANK/WORLD_SIZE/LOCAL_* names."""
    from memrt.launcher import discover_launch

    launch = discover_launch()
    if launch.launcher in ("torchrun", "single"):
        return
    values = {"RANK": launch.rank, "WORLD_SIZE": launch.world_size, "LOCAL_RANK": launch.local_rank,
              "LOCAL_WORLD_SIZE": launch.local_world_size}
    from memrt.activation import session

    session.remember_launch(launch)
    for name, value in values.items():
        os.environ.setdefault(name, str(value))  # a write: the reads stay in memrt/config.py


def start() -> None:
    """Called at interpreter start-up when MEMRT is on (idempotent)."""
    global _STARTED
    if _STARTED:
        return
    _STARTED = True
    try:
        from memrt.config import internal_setting

        reason = excluded_reason(active_pid=internal_setting("MEMRT_AUTOLOAD_ACTIVE"))
        if reason is not None:
            return
        _fill_torchrun_variables()
        from memrt.activation import hooks

        hooks.install()
    except Exception as exc:  # noqa: BLE001 - start-up must never break the user's interpreter
        from memrt.activation import session

        session.fail("start-up", exc)
