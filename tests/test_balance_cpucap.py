"""Slow-rank emulation: a cgroup CPU quota really slows a process, and the cgroup is removed afterwards."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrt.cluster import cpucap
from memrt.cluster.cpucap import can_cap, cap_process, parse_cap_setting

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\nprint(time.process_time())"


def _require(check) -> None:
    """Skip with the reason ``check`` (``can_cap``, ``can_cap_threads``) gives when capping is impossible here."""
    ok, why = check()
    if not ok:
        pytest.skip(why)


def test_parse_cap_setting():
    assert parse_cap_setting("1=0.5,3=0.25") == {1: (0.5, 1.0, "all"), 3: (0.25, 1.0, "all")}
    assert parse_cap_setting("0=max@4,1=0.5@4") == {0: (None, 4.0, "all"), 1: (0.5, 4.0, "all")}
    assert parse_cap_setting("1=0.5@4:compute,2=0.25:all") == {1: (0.5, 4.0, "compute"), 2: (0.25, 1.0, "all")}
    assert parse_cap_setting(None) == {} and parse_cap_setting(" ") == {}
    for bad in ("1:0.5", "1=0.5:gpu"):
        with pytest.raises(ValueError, match="MEMRT_CPU_CAP"):
            parse_cap_setting(bad)


def test_cap_refuses_bad_values_and_says_why_not(monkeypatch):
    with pytest.raises(ValueError, match="cpus"):
        cap_process(None, 0.0)
    with pytest.raises(ValueError, match="period_us"):
        cap_process(None, 0.5, period_us=10)
    with pytest.raises(ValueError, match="threads"):
        cap_process(None, 0.5, threads="io")
    monkeypatch.setattr(cpucap.os, "geteuid", lambda: 1000)
    ok, why = can_cap()
    assert not ok and "root" in why
    with pytest.raises(PermissionError, match="needs root"):
        cap_process(None, 0.5)


@pytest.mark.root
@pytest.mark.slow
def test_cap_limits_cpu_time_and_cleans_up():
    _require(can_cap)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)\n" + BUSY],
                            stdout=subprocess.PIPE, text=True)
    with cap_process(proc.pid, 0.25) as cap:
        assert cap.path.is_dir()
        assert str(proc.pid) in (cap.path / "cgroup.procs").read_text().split()
        out, _ = proc.communicate(timeout=30)
    cpu_s = float(out.strip())
    # 1.5 s of wall-clock busy loop at 0.25 CPU: at most ~0.375 s of CPU (slack for the 20 ms periods)
    assert cpu_s < 0.6, f"capped process used {cpu_s:.2f} s of CPU in 1.5 s"
    assert not cap.path.exists()


@pytest.mark.root
def test_cap_self_and_release_returns_to_origin():
    _require(can_cap)
    cap = cap_process(None, 0.5)
    origin = cap.origin
    assert str(cap.pid) in (cap.path / "cgroup.procs").read_text().split()
    cap.close()
    assert str(cap.pid) in (origin / "cgroup.procs").read_text().split()
    assert not cap.path.exists()
    assert cpucap.remove_stale_caps() == 0


@pytest.mark.root
def test_stale_cleanup_spares_caps_of_live_processes():
    _require(can_cap)
    hierarchy, _ = cpucap._find_hierarchy()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live_dir = hierarchy.root / f"{cpucap._PREFIX}{os.getpid()}-test01"
    dead_dir = hierarchy.root / f"{cpucap._PREFIX}{dead.pid}-test02"
    live_dir.mkdir()
    dead_dir.mkdir()
    try:
        cpucap.remove_stale_caps()  # another rank setting up its cap concurrently must not lose it
        assert live_dir.exists() and not dead_dir.exists()
    finally:
        for d in (live_dir, dead_dir):
            if d.exists():
                d.rmdir()


@pytest.mark.root
@pytest.mark.skipif(not can_cap()[0], reason=f"cannot cap CPU here: {can_cap()[1]}")
def test_benchmark_shim_keeps_its_cap_through_exec():
    """The balance benchmark's rank shim caps itself and then execs the job: the job must run capped."""
    from benchmarks._balance_jobs import _SHIM

    probe = "print(open('/proc/self/cgroup').read())"
    out = subprocess.run([sys.executable, "-c", _SHIM, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RANK": "0", "MEMRT_CPU_CAP": "0=0.5"})
    assert out.returncode == 0, out.stderr
    cpu_line = next(line for line in out.stdout.splitlines() if ":cpu" in line or line.startswith("0::"))
    assert "memrt-cpucap-" in out.stdout, f"the job ran uncapped: {cpu_line}"
    cpucap.remove_stale_caps()


def test_benchmark_refuses_caps_that_cannot_slow_a_rank(monkeypatch):
    from benchmarks._balance_jobs import _check_slowdown, _fair_cpus

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _fair_cpus([1.0, 1.0, 0.5, 0.25], 2) == [0.625, 0.625, 0.5, 0.25]
    _check_slowdown([1.0, 0.5], {0: 100.0, 1: 52.0}, how="caps 1/0.5")  # half as fast: the cap works
    with pytest.raises(RuntimeError, match="did not take effect"):
        _check_slowdown([1.0, 0.5], {0: 100.0, 1: 98.0}, how="caps 1/0.5")
    with pytest.raises(RuntimeError, match="cannot slow"):
        _check_slowdown([1.0, 1.0, 1.0, 0.5], {0: 50.0, 1: 50.0, 2: 50.0, 3: 50.0}, how="caps 1/1/1/0.5")


# The main thread and a thread it starts after the cap hash for 1.5 s each (hashlib releases the GIL, as
# compute and communication threads of a job do); each prints its own CPU seconds.
TWO_THREADS = """
import hashlib, sys, threading, time
sys.stdin.readline()  # capped by now
def spin(out):
    t, block = time.time(), bytes(1 << 20)
    while time.time() - t < 1.5:
        hashlib.sha256(block).digest()
    out.append(time.thread_time())
other = []
th = threading.Thread(target=spin, args=(other,))
th.start()
mine = []
spin(mine)
th.join()
print(mine[0], other[0])
"""


@pytest.mark.root
@pytest.mark.slow
def test_compute_cap_slows_the_main_thread_only():
    _require(can_cap)
    if not cpucap.can_cap_threads()[0]:
        with pytest.raises(PermissionError, match="cgroup v1"):
            cap_process(None, 0.25, threads="compute")
        return
    proc = subprocess.Popen([sys.executable, "-c", TWO_THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    with cap_process(proc.pid, 0.25, threads="compute", priority=8) as cap:
        assert (cap.path / "tasks").read_text().split() == [str(proc.pid)]
        out, _ = proc.communicate("go\n", timeout=30)
        free = cap.free
    main_s, other_s = map(float, out.split())
    # 0.25 CPU for the main thread (about 0.375 s of 1.5 s); the thread it started after the cap ran free
    # (the watcher moved it out of the capped cgroup within ~10 ms), so it got several times more
    assert main_s < 0.6, f"capped main thread used {main_s:.2f} s of CPU in 1.5 s"
    assert other_s > 2 * main_s, f"the uncapped thread used {other_s:.2f} s of CPU, the capped one {main_s:.2f} s"
    assert not cap.path.exists() and not free.exists()


# A process caps its own main thread (as a rank does from MEMRT_CPU_CAP), starts a thread, and reports which
# cgroups its threads are in, then lifts the cap.
SELF_CAP = """
import threading, time
from pathlib import Path
from memrt.cluster.cpucap import cap_process
def cgroup(tid):
    for line in Path(f"/proc/self/task/{tid}/cgroup").read_text().splitlines():
        if "cpu" in line.split(":")[1].split(","):
            return line.split(":", 2)[2]
cap = cap_process(None, 0.5, threads="compute")
stop = threading.Event()
th = threading.Thread(target=stop.wait)
th.start()
time.sleep(0.3)
import os
main, other = cgroup(os.getpid()), cgroup(th.native_id)
stop.set(); th.join()
cap.close()
print(main, other, cgroup(os.getpid()), cap.path.exists(), cap.free.exists(), cap.path)
"""


@pytest.mark.root
def test_compute_cap_of_itself_places_threads_and_cleans_up():
    _require(cpucap.can_cap_threads)
    out = subprocess.run([sys.executable, "-c", SELF_CAP], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    main, other, after, capped_left, free_left, path = out.stdout.split()
    assert main.rsplit("/", 1)[1].startswith("memrt-cpucap-") and not main.endswith("-free")
    assert other == main + "-free"  # born in the capped cgroup, moved by the watcher
    assert "memrt-cpucap-" not in after and capped_left == "False" and free_left == "False"
    time.sleep(0.3)  # the watcher exits once the cap is gone (it names the capped cgroup on its command line)
    watchers = [p for p in Path("/proc").glob("[0-9]*") if path in _cmdline(p)]
    assert not watchers
    assert cpucap.remove_stale_caps() == 0


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
