"""One rank of :func:`memrt.testing.launch.run_processes`: ``python -m memrt.testing.rank_call DIR``.

Loads ``(fn, args, init_process_group, pg_timeout_s)`` from ``DIR/call.pkl``, joins a gloo group on the
store the launcher holds at MASTER_ADDR:MASTER_PORT, runs ``fn(rank, world_size, *args)`` and writes ``("ok", result)`` or
``("error", message)`` to ``DIR/result-<rank>.pkl``; a failure also exits 1.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from memrt.launcher import discover_launch


def main(directory: str) -> int:
    info = discover_launch()
    out = Path(directory) / f"result-{info.rank}.pkl"
    try:
        fn, args, init_pg, pg_timeout_s = pickle.loads((Path(directory) / "call.pkl").read_bytes())
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_pg:  # the launcher holds the store at MASTER_PORT
            store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False,
                                  timeout=timedelta(seconds=pg_timeout_s))
            dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
        result = fn(info.rank, info.world_size, *args)
        if init_pg and dist.is_initialized():
            dist.destroy_process_group()
        outcome, code = ("ok", result), 0
    except BaseException as exc:  # every failure goes back to the launcher, named by rank
        outcome, code = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), 1
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.replace(out)  # whole or absent: the launcher never reads half a result
    return code


def _exit(code: int) -> None:
    """Run the exit handlers, then leave without tearing the interpreter down: gloo's worker threads may still
    be freeing tensors, which needs the GIL that interpreter shutdown takes away (torch then aborts the process
    after its work is done, and the launcher would count a finished rank as failed)."""
    time.sleep(0.05)  # let them finish first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1]))
