"""Offload failure behaviour: clear errors naming the folder, no files left (exception, SIGTERM, corruption)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from memrt.memory.offload import OffloadEngine, OffloadError, offload_units
from memrt.memory.offload import cleanup
from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss


pytestmark = pytest.mark.usefixtures("one_thread")


def _saved_forward(engine, n=4, size=64 * 1024):
    """A graph whose saved tensors (tanh outputs) go through ``engine``; returns the loss."""
    x = torch.randn(size // 4, requires_grad=True)
    with engine.pack_hooks(0):
        ys = [torch.tanh(x * (i + 1)) for i in range(n)]
    return sum(y.sum() for y in ys)


def test_short_read_is_detected(tmp_path):
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=16, verify=False)
    try:
        loss = _saved_forward(engine)
        engine.synchronize()
        (f,) = list(engine.directory.iterdir())
        os.truncate(f, f.stat().st_size // 2)
        with pytest.raises(Exception, match="short read .* truncated") as info:
            loss.backward()
        assert str(engine.directory) in str(info.value)
    finally:
        engine.close()
    assert list(tmp_path.iterdir()) == []


def test_corruption_detected_in_verify_mode(tmp_path):
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=16, verify=True)
    try:
        loss = _saved_forward(engine)
        engine.synchronize()
        (f,) = list(engine.directory.iterdir())
        with open(f, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(Exception, match="corrupt offloaded activations .*CRC32"):
            loss.backward()
    finally:
        engine.close()


def test_verify_mode_follows_debug_log_level(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRT_LOG_LEVEL", "debug")
    with OffloadEngine("disk", directory=tmp_path) as engine:
        assert engine._tier.verify
    monkeypatch.setenv("MEMRT_LOG_LEVEL", "warning")
    with OffloadEngine("disk", directory=tmp_path) as engine:
        assert not engine._tier.verify


def test_offload_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(tmp_path / "spill"))
    with OffloadEngine("disk") as engine:
        assert engine.directory.parent == tmp_path / "spill"


def test_free_space_checked_against_the_plan(tmp_path):
    with OffloadEngine("disk", directory=tmp_path) as engine:
        engine.check_space(1024)  # fits
        with pytest.raises(OffloadError, match=f"offload folder {engine.directory}.*MEMRT_OFFLOAD_DIR"):
            engine.check_space(10**18)


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match=f"{blocker}.*MEMRT_OFFLOAD_DIR"):
        OffloadEngine("disk", directory=blocker / "sub")


@pytest.mark.root
def test_disk_full_mid_run_is_a_clear_error_and_leaves_nothing(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        engine = OffloadEngine("disk", directory=mnt, min_bytes=16)
        try:
            with pytest.raises(OffloadError, match=f"{mnt}.*MEMRT_OFFLOAD_DIR") as info:
                loss = _saved_forward(engine, n=8, size=128 * 1024)  # 1 MiB into 256 KiB
                engine.synchronize()
                loss.backward()
            assert "No space left" in str(info.value) or "space" in str(info.value).lower()
            with pytest.raises(OffloadError):  # the engine stays failed: no partial state is used
                engine.before_backward(0)
        finally:
            engine.close()
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    return dead.pid


def test_stale_folders_of_dead_processes_of_this_host_only_are_swept(tmp_path):
    host = socket.gethostname().replace("-", "_")
    pid = _dead_pid()
    stale = tmp_path / f"memrt-offload-{host}-{pid}-abc"
    stale.mkdir()
    (stale / "unit0-1.bin").write_bytes(b"x" * 10)
    alive = tmp_path / f"memrt-offload-{host}-{os.getpid()}-keep"
    other_host = tmp_path / f"memrt-offload-elsewhere_node7-{pid}-abc"  # same pid, another host: never ours
    unnamed = tmp_path / f"memrt-offload-{pid}-abc"  # no host in the name: cannot be known to be ours
    for d in (alive, other_host, unnamed):
        d.mkdir()
    with OffloadEngine("disk", directory=tmp_path) as engine:
        assert engine.directory.name.startswith(f"memrt-offload-{host}-{os.getpid()}-")
        assert not stale.exists() and alive.exists() and other_host.exists() and unnamed.exists()
    for d in (alive, other_host, unnamed):
        d.rmdir()
    assert list(tmp_path.iterdir()) == []


def test_sigkill_leftovers_in_the_default_temp_dir_are_swept_at_the_next_start(tmp_path):
    """A process killed with its offload folder in the temp dir (MEMRT_OFFLOAD_DIR unset): the next one sweeps it."""
    child = textwrap.dedent("""
        import os, sys, time, torch
        from memrt.memory.offload import OffloadEngine
        engine = OffloadEngine("disk")
        x = torch.randn(256, 1024, requires_grad=True)
        with engine.pack_hooks(0):
            y = (x * 2).sin()
        engine._tier.wait_written(None)
        print(engine.directory, flush=True)
        time.sleep(600)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True)
    try:
        folder = Path(proc.stdout.readline().strip())
        assert folder.parent == tmp_path and folder.is_dir()
    finally:
        proc.kill()
        proc.wait()
    assert folder.exists()  # SIGKILL: no handler ran
    code = "from memrt.memory.offload import OffloadEngine\nwith OffloadEngine('disk') as e: pass"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []


_CHILD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss
    from memrt.memory.offload import offload_units
    cfg = GPTConfig(n_layer=4, d_model=64, seq_len=64)
    x, y = gpt_batch(cfg, 8)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    h = offload_units(model, list(model.blocks), "disk", directory=sys.argv[1], min_bytes=1024)
    print("ready", flush=True)
    while True:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
""")


@pytest.mark.slow
def test_sigterm_mid_step_leaves_no_offload_files(tmp_path):
    spill = tmp_path / "spill"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(spill)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        seen = []
        while time.monotonic() < deadline and not seen:  # files exist only between forward and backward
            seen = list(spill.glob("memrt-offload-*/*.bin"))
            time.sleep(0.002)
        assert seen, "the training process never had offload files"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert rc == -signal.SIGTERM  # default action preserved after cleanup
    assert not spill.exists()  # memrt created the folder (0700): it goes too


def test_forked_child_does_not_remove_parent_folders(tmp_path):
    engine = OffloadEngine("disk", directory=tmp_path)
    try:
        pid = os.fork()
        if pid == 0:  # child: what a DataLoader worker would do at exit
            cleanup._remove_all_own()
            os._exit(0)
        os.waitpid(pid, 0)
        assert engine.directory.exists()
    finally:
        engine.close()
    assert not engine.directory.exists()


def test_plan_larger_than_free_space_fails_before_the_first_write(tmp_path):
    import memrt
    from memrt.memory.planner import Plan, UnitPlan

    cfg = GPTConfig(n_layer=2, d_model=32, seq_len=16)
    x, y = gpt_batch(cfg, 2)
    model = GPT(cfg)
    plan = Plan(units=[UnitPlan(name=f"blocks.{i}", action="offload_disk", bytes_moved=10**18) for i in range(2)])
    memrt.apply(model, plan, offload_dir=str(tmp_path))
    try:
        with pytest.raises(OffloadError, match=f"offload folder {tmp_path}.* free but the plan writes"):
            lm_loss(model(x), y)
    finally:
        memrt.disable(model)
    assert list(tmp_path.iterdir()) == []
