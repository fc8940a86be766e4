"""No hangs: a killed rank is named by every survivor within 60 s; mismatched arguments are reported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrt.config import environ

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_killed_rank_is_named_by_every_survivor_within_60s(tmp_path):
    world, victim = 4, 2
    port = _free_port()
    procs, logs = [], []
    for r in range(world):
        env = environ()
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MEMRT_TOPOLOGY="0,1;2,3", MEMRT_COMM="hier",
                   OMP_NUM_THREADS="1")
        out = open(tmp_path / f"rank{r}.out", "w+")
        logs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "_comm_kill_child.py")], env=env, stdout=out,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 120
        while not all("ready" in (tmp_path / f"rank{r}.out").read_text() for r in range(world)):
            assert time.monotonic() < deadline, "ranks did not start"
            assert all(p.poll() is None for p in procs), [(tmp_path / f"rank{r}.out").read_text() for r in range(world)]
            time.sleep(0.2)
        time.sleep(0.5)  # inside the loop of all-reduces
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for r, p in enumerate(procs):
            if r == victim:
                continue
            rc = p.wait(timeout=max(1.0, 60 - (time.monotonic() - killed_at)))
            text = (tmp_path / f"rank{r}.out").read_text()
            assert rc != 0, f"rank {r} exited 0:\n{text}"
            assert f"rank(s) [{victim}]" in text, f"rank {r} did not name rank {victim}:\n{text[-3000:]}"
        elapsed = time.monotonic() - killed_at
        assert elapsed < 60, elapsed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
