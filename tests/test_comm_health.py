"""No hangs: a killed rank is named by every survivor within 60 s, a frozen one is reported by the watchdog.

Both on the memrt.comm API path (blocking calls, and async calls waited through their future) and under
``MEMRT=1`` with an unchanged DDP script, whose gradient buckets go through memrt's DDP comm hook as futures.
Ranks are started directly (as on a cluster where each node has its own launcher), not by one torchrun that
would end the whole job itself when a worker dies. Each case asserts the survivors' exit status, the one line
naming the rank and the operation, the time to a clear exit, and that nothing is left in the job's folders.
``pytest -s tests/test_comm_health.py | grep ^fault-time`` prints the measured times.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _faults import REPO, clean_env, record_time
from memrt.comm.health import HealthMonitor
from memrt.launcher import free_port

HERE = Path(__file__).parent
DEEP = REPO / "tests" / "scripts" / "deep_ddp.py"
"""An unchanged DDP script whose plan at 7 MiB must offload to disk (see tests/test_faults_offload.py)."""
KILL_BOUND_S = 60.0
"""A dead peer: every survivor names it and exits within this many seconds."""
HANG_S = HealthMonitor.__init__.__kwdefaults__["hang_s"]
STOP_BOUND_S = HANG_S + 20.0
"""A frozen peer: the watchdog reports it after ``hang_s`` in a collective; the rest is slack for a loaded
2-core machine (the wait this replaces had no end: gloo's own timeout is 30 min)."""


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap_ranks():
    """Every rank a test started is gone after it, also when an assertion ends the test early."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _start(tmp: Path, world: int, argv: list[str], *, per_node: int, **extra: str) -> list[subprocess.Popen]:
    port = free_port()
    procs: list[subprocess.Popen] = []
    for r in range(world):
        env = clean_env(tmp, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % per_node),
                        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
        out = open(tmp / f"rank{r}.out", "w")
        procs.append(subprocess.Popen(argv, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, text=True))
        out.close()
        _STARTED.append(procs[-1])
    return procs


def _text(tmp: Path, r: int) -> str:
    return (tmp / f"rank{r}.out").read_text()


def _wait_running(tmp: Path, procs: list[subprocess.Popen], marker: str, ranks: list[int]) -> None:
    deadline = time.monotonic() + 120
    while not all(marker in _text(tmp, r) for r in ranks):
        assert time.monotonic() < deadline, "ranks did not start"
        assert all(p.poll() is None for p in procs), [_text(tmp, r)[-2000:] for r in range(len(procs))]
        time.sleep(0.2)
    time.sleep(0.5)  # inside the loop of collectives


def _fault(tmp: Path, procs: list[subprocess.Popen], victim: int, sig: int, bound_s: float) -> dict[int, tuple[int, float]]:
    """Signal ``victim``; (exit code, seconds after the signal) of every other rank."""
    out = {}
    try:
        procs[victim].send_signal(sig)
        t0 = time.monotonic()
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                rc = p.wait(timeout=max(1.0, bound_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running {bound_s:.0f} s after the fault:\n{_text(tmp, r)[-3000:]}")
            out[r] = (rc, time.monotonic() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    return out


def _memrt_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("memrt.comm: ")]


def _left_behind(tmp: Path) -> list[str]:
    """What the job left in its folder and private TMPDIR besides the logs and memrt's report."""
    left = [p.name for p in tmp.iterdir() if not p.name.endswith(".out") and p.name not in ("tmp", "memrt-report")]
    left += [f"tmp/{p.name}" for p in (tmp / "tmp").iterdir() if not p.name.startswith("torch")]
    return left


@pytest.mark.slow
def test_killed_rank_is_named_by_every_survivor_within_60s(tmp_path):
    world, victim = 4, 2
    procs = _start(tmp_path, world, [sys.executable, str(HERE / "_comm_kill_child.py")], per_node=2,
                   MEMRT_TOPOLOGY="0,1;2,3", MEMRT_COMM="hier")
    _wait_running(tmp_path, procs, "ready", list(range(world)))
    exits = _fault(tmp_path, procs, victim, signal.SIGKILL, KILL_BOUND_S)
    for r, (rc, _) in exits.items():
        text = _text(tmp_path, r)
        assert rc != 0, f"rank {r} exited 0:\n{text}"
        assert f"rank(s) [{victim}]" in text, f"rank {r} did not name rank {victim}:\n{text[-3000:]}"
    record_time("sigkill-api-hier-4-ranks", max(s for _, s in exits.values()))
    assert _left_behind(tmp_path) == []
    pids = {str(p.pid) for p in procs}
    shm = Path("/dev/shm")
    slabs = [p.name for p in shm.glob("memrt-shm-*")] if shm.is_dir() else []
    assert [n for n in slabs if n.split("-")[3] in pids] == []  # intra-node slabs of this job: none left


@pytest.mark.slow
@pytest.mark.parametrize("path", ["blocking", "future"])
def test_frozen_rank_is_reported_by_the_watchdog_on_the_api_path(tmp_path, path):
    argv = [sys.executable, str(HERE / "_comm_kill_child.py")] + (["--async"] if path == "future" else [])
    procs = _start(tmp_path, 2, argv, per_node=2)
    _wait_running(tmp_path, procs, "ready", [0, 1])
    (rc, seconds), = _fault(tmp_path, procs, 1, signal.SIGSTOP, STOP_BOUND_S).values()
    text = _text(tmp_path, 0)
    lines = _memrt_lines(text)
    assert rc == 1, text[-3000:]
    assert len(lines) == 1 and "in all_reduce: rank(s) [1] stopped responding" in lines[0], text[-3000:]
    assert seconds >= HANG_S, f"reported after {seconds:.1f} s, before the watchdog's {HANG_S} s"
    record_time(f"sigstop-api-{path}", seconds)
    assert _left_behind(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_frozen_or_dead_rank_under_memrt_ddp_ends_with_one_line(tmp_path, sig):
    """MEMRT=1 and an unchanged DDP script: the gradient all-reduce runs in memrt's comm hook (a future).

    The plan offloads to disk (MEMRT_OFFLOAD_DIR): the survivor removes its own offload files on the way out
    (also when the watchdog ends it with os._exit); the victim's are for the next start on the host to sweep."""
    spill = tmp_path / "spill"
    procs = _start(tmp_path, 2, [sys.executable, str(DEEP), "--steps", "1000000"], per_node=2,
                   MEMRT="1", MEMRT_OFFLOAD="disk", MEMRT_BUDGET="7MiB", MEMRT_OFFLOAD_DIR=str(spill))
    _wait_running(tmp_path, procs, "step 5 ", [0])
    assert any(spill.glob(f"memrt-offload-*-{procs[0].pid}-*")), "rank 0 does not offload"
    victim_pid = procs[1].pid
    bound = STOP_BOUND_S if sig == "SIGSTOP" else KILL_BOUND_S
    (rc, seconds), = _fault(tmp_path, procs, 1, getattr(signal, sig), bound).values()
    text = _text(tmp_path, 0)
    lines = _memrt_lines(text)
    assert rc == 1, text[-3000:]
    assert len(lines) == 1, text[-4000:]
    if sig == "SIGSTOP":
        assert "waited" in lines[0] and "in all_reduce: rank(s) [1] stopped responding" in lines[0], lines
        assert seconds >= HANG_S
    else:
        assert "all_reduce failed on rank 0: rank(s) [1] are gone" in lines[0], lines
        assert "Connection" in lines[0]  # gloo's own reason stays, at the end of the line
    record_time(f"{sig.lower()}-memrt-ddp", seconds)
    # the victim's folder stays for the next start to sweep, and with it the marker of the level memrt made
    assert [p.name for p in spill.iterdir() if f"-{victim_pid}" not in p.name] == [".memrt-made"]
    assert _left_behind(tmp_path) == ["spill"]
