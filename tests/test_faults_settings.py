"""Settings that cannot apply say why; corrupt caches are re-measured; the offload folder is checked before use;
shared-memory slabs and caches are private.

Fast, in-process checks (plus a few short subprocesses where a second process or a process exit is the point):
``MEMRT_OFFLOAD=host`` without CUDA, ``MEMRT_COMPRESS`` in a job with no inter-node hop, the offload bandwidth
cache and the comm link cache holding junk, an offload folder that is a file / missing / shared by two
processes with room for one plan, slab and cache permissions, slabs and folders of dead processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memrt import errors
from memrt.agreement import decide
from memrt.memory.offload import bandwidth, folder
from memrt.memory.offload.bandwidth import Bandwidths, load_bandwidths

HOST = socket.gethostname().replace("-", "_")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in [v for v in os.environ if v.startswith("MEMRT")]:
        monkeypatch.delenv(var)
    folder.reset()
    monkeypatch.setattr(errors, "_DEGRADED", [])
    yield
    folder.reset()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def _profile(*unit_bytes: int) -> SimpleNamespace:
    return SimpleNamespace(units=[SimpleNamespace(saved_bytes=b, input_bytes=b // 4) for b in unit_bytes])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ settings that cannot apply here
def test_host_tier_without_cuda_is_a_warning_naming_the_setting(caplog):
    with caplog.at_level(logging.WARNING):
        assert folder.usable_tiers(_profile(1 << 20), "host", "cpu") == ()
        assert folder.usable_tiers(_profile(1 << 20), "host", "cpu") == ()  # once per process
    lines = _warnings(caplog)
    assert len(lines) == 1 and lines[0].startswith("memrt: MEMRT_OFFLOAD=host: the host tier needs a CUDA device")
    assert errors.degraded() and "MEMRT_OFFLOAD=host" in errors.degraded()[0]


def test_auto_offload_on_cpu_keeps_the_disk_tier_silently(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert folder.usable_tiers(_profile(1 << 20), "auto", "cpu") == ("disk",)
    assert _warnings(caplog) == [] and errors.degraded() == []


def _entries(nodes: list[str], codec: str = "int8", topology: str = "unset") -> dict:
    values = {"MEMRT": True, "MEMRT_OFFLOAD": "auto", "MEMRT_COMM": "auto", "MEMRT_COMPRESS": codec,
              "MEMRT_TOPOLOGY": topology}
    return {r: {"values": values, "sources": {}, "error": None, "node": n} for r, n in enumerate(nodes)}


@pytest.mark.parametrize("nodes,topology,why", [
    (["a", "a"], "unset", "every rank is on one node"),
    (["a", "b", "c"], "unset", "every node has one rank"),
    (["a", "a", "a", "a"], "0;1;2;3", "every node has one rank"),
    (["a", "a", "a", "a"], "0,1,2,3", "every rank is on one node"),
])
def test_compression_without_an_inter_node_hop_is_named(nodes, topology, why):
    verdict = decide(_entries(nodes, topology=topology), len(nodes), 0.0)
    assert verdict["notes"] == [f"MEMRT_COMPRESS=int8 does nothing in this job: {verdict['notes'][0].split(': ', 1)[1]}"]
    assert why in verdict["notes"][0] and "all-reduced exactly" in verdict["notes"][0]


@pytest.mark.parametrize("nodes,topology,codec", [(["a", "a", "b", "b"], "unset", "int8"),
                                                  (["a", "a", "a", "a"], "0,1;2,3", "bf16"),
                                                  (["a", "a"], "unset", "none")])
def test_compression_with_an_inter_node_hop_or_off_says_nothing(nodes, topology, codec):
    assert decide(_entries(nodes, codec, topology), len(nodes), 0.0)["notes"] == []


# ------------------------------------------------------------------ corrupt caches
def _fake_probe(calls: list):
    def probe(device="cpu", directory=None, **kw):
        calls.append(directory)
        return Bandwidths(device="cpu", disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9,
                          directory=str(directory), measured_at=1.0)
    return probe


GOOD = {"device": "cpu", "disk_write_bytes_per_s": 1e9, "disk_read_bytes_per_s": 2e9, "d2h_bytes_per_s": None,
        "h2d_bytes_per_s": None, "directory": "/x", "probe_bytes": 1 << 20, "measured_at": 1.0}
BAD_ENTRIES = [0, None, "fast", [], {}, {**GOOD, "disk_write_bytes_per_s": 0}, {**GOOD, "disk_read_bytes_per_s": -5.0},
               {**GOOD, "disk_write_bytes_per_s": None}, {**GOOD, "disk_read_bytes_per_s": "fast"},
               {**GOOD, "disk_write_bytes_per_s": True}, {**GOOD, "d2h_bytes_per_s": 0},
               {**GOOD, "probe_bytes": "1"}, {**GOOD, "extra": 1}, {k: v for k, v in GOOD.items() if k != "device"}]
BAD_FILES = ["0", "null", '"fast"', "[1, 2]", '{"cpu|1": {"device": "cpu", "disk_wr', "", "\x00\x01"]


@pytest.mark.parametrize("entry", BAD_ENTRIES, ids=lambda e: json.dumps(e)[:40])
def test_a_corrupt_bandwidth_cache_entry_is_measured_again_with_one_warning(tmp_path, monkeypatch, caplog, entry):
    cache = tmp_path / "bandwidth.json"
    key = f"cpu|{bandwidth._fs_key(tmp_path)}"
    cache.write_text(json.dumps({key: entry}))
    calls: list = []
    monkeypatch.setattr(bandwidth, "probe_bandwidths", _fake_probe(calls))
    with caplog.at_level(logging.WARNING):
        bw = load_bandwidths("cpu", str(tmp_path), cache_path=cache)
    assert bw.disk_write_bytes_per_s == 1e9 and len(calls) == 1
    lines = _warnings(caplog)
    assert len(lines) == 1 and "ignoring the offload bandwidth cache entry" in lines[0] and "measuring again" in lines[0]
    assert Bandwidths.from_dict(json.loads(cache.read_text())[key]) == bw  # replaced by the new figures


@pytest.mark.parametrize("text", BAD_FILES, ids=repr)
def test_a_corrupt_bandwidth_cache_file_is_measured_again_with_one_warning(tmp_path, monkeypatch, caplog, text):
    cache = tmp_path / "bandwidth.json"
    cache.write_text(text)
    calls: list = []
    monkeypatch.setattr(bandwidth, "probe_bandwidths", _fake_probe(calls))
    with caplog.at_level(logging.WARNING):
        load_bandwidths("cpu", str(tmp_path), cache_path=cache)
    lines = _warnings(caplog)
    assert len(calls) == 1 and len(lines) == 1 and "ignoring the offload bandwidth cache" in lines[0]
    assert json.loads(cache.read_text())  # rewritten whole


def test_the_bandwidth_cache_is_private_and_the_probe_measures_the_offload_folder(tmp_path, monkeypatch):
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(spill))
    cache = tmp_path / "cache" / "deeper" / "bandwidth.json"
    bw = load_bandwidths("cpu", cache_path=cache)
    assert bw.directory == str(spill)  # the folder the disk tier writes to, not the temp dir
    assert _mode(cache) == 0o600 and _mode(cache.parent) == 0o700 and _mode(cache.parent.parent) == 0o700
    assert list(spill.iterdir()) == []


LINK = {"intra": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "shared_beta_s_per_byte": None}, "inter": None,
        "gamma_s_per_byte": 1e-10, "codec_s_per_byte": {"int8": 1e-9}, "call_overhead_s": {"flat": -1e-6},
        "mid_overhead_s": {}, "efficiency": {"flat": 0.8}, "topology_key": "k", "measured_at": "t",
        "probe_seconds": 1.0}
BAD_LINKS = ["0", "null", '"fast"', '{"intra": {"alpha_s": 1', json.dumps({**LINK, "intra": None}),
             json.dumps({**LINK, "intra": {"alpha_s": "fast", "beta_s_per_byte": 1e-9}}),
             json.dumps({**LINK, "intra": {"alpha_s": -1.0, "beta_s_per_byte": 1e-9}}),
             json.dumps({**LINK, "intra": {**LINK["intra"], "shared_beta_s_per_byte": "x"}}),
             json.dumps({**LINK, "gamma_s_per_byte": None}), json.dumps({**LINK, "efficiency": {"flat": 0}}),
             json.dumps({**LINK, "codec_s_per_byte": {"int8": "fast"}}), json.dumps({**LINK, "efficiency": [1]}),
             json.dumps({k: v for k, v in LINK.items() if k != "intra"}), json.dumps({**LINK, "bogus": 1})]


@pytest.mark.parametrize("text", BAD_LINKS, ids=lambda t: t[:40])
def test_a_corrupt_comm_link_cache_is_refused_with_a_value_error(text):
    from memrt.comm.probe import checked_link_model

    checked_link_model(json.dumps(LINK))
    with pytest.raises(ValueError):
        checked_link_model(text)


# ------------------------------------------------------------------ the offload folder
def test_an_offload_folder_that_is_a_file_drops_the_disk_tier_with_one_warning(tmp_path, monkeypatch, caplog):
    target = tmp_path / "afile"
    target.write_text("")
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(target))
    with caplog.at_level(logging.WARNING):
        assert folder.usable_tiers(_profile(1 << 20), "disk", "cpu") == ()
        assert folder.usable_tiers(_profile(1 << 20), "auto", "cpu") == ()
    lines = _warnings(caplog)
    assert len(lines) == 1 and f"MEMRT_OFFLOAD_DIR={target} cannot take offloaded activations" in lines[0]
    assert "is not a directory" in lines[0] and "planning without the disk tier" in lines[0]
    assert len(errors.degraded()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_memrt_auto_plans_with_the_folder_of_the_config_it_is_given(tmp_path, monkeypatch, caplog):
    """The offload folder the planner checks is the one memrt.auto was configured with, not the environment's:
    a config naming a file drops the disk tier (with the warning naming it) although the environment has none."""
    import memrt
    from memrt.config import load_config
    from memrt.testing.models import GPT, GPTConfig, lm_loss

    monkeypatch.delenv("MEMRT_OFFLOAD_DIR", raising=False)
    target = tmp_path / "afile"
    target.write_text("")
    config = load_config(warn_unknown=False, offload_dir=str(target))
    assert folder.usable_tiers(_profile(1 << 20), "disk", "cpu") == ("disk",)  # the environment's: the temp dir
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    memrt.auto(model, budget="64GiB", offload="disk", config=config)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # profiled, planned, planned step
            lm_loss(model(x), x).backward()
    assert memrt.plan_of(model) is not None
    memrt.disable(model)
    lines = [line for line in _warnings(caplog) if "cannot take offloaded activations" in line]
    assert len(lines) == 1 and f"MEMRT_OFFLOAD_DIR={target}" in lines[0], _warnings(caplog)


def test_strict_mode_makes_an_unusable_offload_folder_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(tmp_path / "afile"))
    monkeypatch.setenv("MEMRT_STRICT", "1")
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as info:
        folder.usable_tiers(_profile(1 << 20), "disk", "cpu")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memrt: error: MEMRT_OFFLOAD_DIR=") and "(MEMRT_STRICT=1)" in err[0]


def test_a_read_only_offload_folder_drops_the_disk_tier(tmp_path, monkeypatch, caplog):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("needs root to mount a read-only filesystem")
    try:
        monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(ro))
        with caplog.at_level(logging.WARNING):
            assert folder.usable_tiers(_profile(1 << 10), "disk", "cpu") == ()
        lines = _warnings(caplog)
        assert len(lines) == 1 and f"cannot write in {ro}" in lines[0], lines
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


_CHAIN_CHILD = textwrap.dedent("""
    import os, stat, sys
    from pathlib import Path
    from memrt.memory.offload.folder import check_folder
    os.umask(0o022)
    top = Path(sys.argv[1])
    check = check_folder(top / "b" / "c", 1 << 20)
    assert check.problem is None, check.problem
    print(" ".join(oct(stat.S_IMODE(p.stat().st_mode)) for p in (top, top / "b", top / "b" / "c")))
""")


def test_a_missing_folder_chain_is_created_0700_and_removed_at_exit(tmp_path):
    top = tmp_path / "a"
    out = subprocess.run([sys.executable, "-c", _CHAIN_CHILD, str(top)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0o700", "0o700", "0o700"]  # not 0755 under umask 022
    assert not top.exists()  # created by memrt, left empty: removed at exit with the reservation file


_SHARER = textwrap.dedent("""
    import sys, time
    from memrt.memory.offload.folder import check_folder
    check = check_folder(sys.argv[1], int(sys.argv[2]))
    print("ok" if check.problem is None else check.problem, flush=True)
    sys.stdin.readline()
""")


def test_two_processes_on_one_filesystem_with_room_for_one_plan_do_not_both_pass(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    need = int(0.6 * free)  # one plan with its margin: 75% of the free space; two: 150% (robust to other jobs)
    first = subprocess.Popen([sys.executable, "-c", _SHARER, str(tmp_path), str(need)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "ok"
        second = subprocess.run([sys.executable, "-c", _SHARER, str(tmp_path), str(need)], input="\n",
                                capture_output=True, text=True, timeout=120)
        assert "by the 2 processes sharing it" in second.stdout and "free, but the plan may write" in second.stdout
        assert [p.name for p in tmp_path.iterdir()] == [f"memrt-reserve-{HOST}-{first.pid}"]
    finally:
        first.communicate("\n", timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_reservations_of_dead_processes_on_this_host_are_swept_and_other_hosts_kept(tmp_path):
    dead = tmp_path / f"memrt-reserve-{HOST}-{_dead_pid()}"
    dead.write_text(str(10 ** 15))  # would make any check fail if counted
    other = tmp_path / "memrt-reserve-elsewhere_7-1"
    other.write_text("1000")
    check = folder.check_folder(tmp_path, 1000)
    assert check.problem is None and check.sharers == 2 and check.shared_bytes == 2000
    assert not dead.exists() and other.exists()


# ------------------------------------------------------------------ shared-memory slabs
def test_slabs_are_created_0600_whatever_the_umask(tmp_path):
    from memrt.comm.shm import _create_private

    old = os.umask(0)
    try:
        t = _create_private(tmp_path / "slab", 8192)
    finally:
        os.umask(old)
    assert t.numel() == 8192 and _mode(tmp_path / "slab") == 0o600
    with pytest.raises(FileExistsError):  # never opens a file someone planted under the name
        _create_private(tmp_path / "slab", 8192)


def test_slabs_of_dead_processes_on_this_host_are_swept(tmp_path):
    from memrt.comm.shm import sweep_stale_slabs

    dead = tmp_path / f"memrt-shm-{HOST}-{_dead_pid()}-tok-0-1-0"
    alive = tmp_path / f"memrt-shm-{HOST}-{os.getpid()}-tok-0-1-0"
    other = tmp_path / f"memrt-shm-elsewhere_7-{_dead_pid()}-tok-0-1-0"
    for p in (dead, alive, other):
        p.write_bytes(b"x")
    assert sweep_stale_slabs(tmp_path) == 1
    assert not dead.exists() and alive.exists() and other.exists()


_SHM_CHILD = textwrap.dedent("""
    import os, sys, stat, tempfile
    from pathlib import Path
    import torch, torch.distributed as dist
    from memrt.comm import shm
    shm.SHM_DIR = Path(sys.argv[1])
    os.umask(0)
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    tier = shm.ShmTier(dist.new_group([0], backend="gloo"), [0], 0)
    modes = []
    real = shm.torch.from_file
    shm.torch.from_file = lambda p, **kw: (modes.append(stat.S_IMODE(os.stat(p).st_mode)), real(p, **kw))[1]
    t = torch.arange(10.0)
    tier.all_reduce(t, "SUM")
    assert modes and set(modes) == {0o600}, modes
    assert list(shm.SHM_DIR.iterdir()) == []
    calls = []
    def failing_barrier():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("peer died")
    tier._barrier = failing_barrier
    try:
        tier.all_reduce(torch.zeros(1 << 20), "SUM")  # grows the slabs: the second barrier fails
    except RuntimeError:
        pass
    assert list(shm.SHM_DIR.iterdir()) == [], list(shm.SHM_DIR.iterdir())
    dist.destroy_process_group()
    print("ok")
""")


def test_slabs_are_private_and_removed_when_a_growth_fails(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SHM_CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_plan_without_room_in_the_offload_folder_is_made_again_without_the_disk_tier(tmp_path, monkeypatch,
                                                                                         caplog):
    """The folder is checked against the plan's own disk bytes when the plan is made, before any step writes."""
    import memrt
    from memrt.errors import BudgetError
    from memrt.memory.planner import min_feasible_budget
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=6, d_model=32, seq_len=64, n_head=1, dropout=0.0)
    x, y = gpt_batch(cfg, 16)
    torch.manual_seed(0)
    model = GPT(cfg)
    prof = memrt.profile(model, lambda: lm_loss(model(x), y).backward())
    bw = load_bandwidths("cpu", str(tmp_path), cache_path=tmp_path / "bw.json")
    floor = min_feasible_budget(prof)
    budget = (min_feasible_budget(prof, offload="disk", bandwidths=bw) + floor) // 2  # only a disk plan fits
    spill = tmp_path / "spill"
    monkeypatch.setenv("MEMRT_OFFLOAD_DIR", str(spill))
    plan = memrt.plan(prof, budget, offload="disk", bandwidths=bw)
    moved = sum(u.bytes_moved for u in plan.units if u.action.endswith("offload_disk"))
    assert moved > 0
    mine = spill / f"memrt-reserve-{HOST}-{os.getpid()}"
    assert mine.read_text() == str(moved) and _mode(mine) == 0o600
    # another live process of this host now holds all the room left: the same plan no longer fits
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        (spill / f"memrt-reserve-{HOST}-{holder.pid}").write_text(str(shutil.disk_usage(spill).free))
        folder.reset()
        with caplog.at_level(logging.WARNING), pytest.raises(BudgetError):
            memrt.plan(prof, budget, offload="disk", bandwidths=bw)
        lines = _warnings(caplog)
        assert len(lines) == 1 and "by the 2 processes sharing it" in lines[0], lines
        assert "planning without the disk tier" in lines[0]
        assert not mine.exists()  # a refused reservation is withdrawn
        with_room = memrt.plan(prof, floor, offload="disk", bandwidths=bw)  # feasible without the disk tier
        assert not any(u.action.endswith("offload_disk") for u in with_room.units)
        assert len(_warnings(caplog)) == 1  # warned once
    finally:
        holder.communicate(b"\n", timeout=30)


def test_the_disk_probe_writes_no_more_than_an_eighth_of_the_room_others_left(tmp_path):
    """Ranks sharing a small folder may write activations while another probes it: the probe stays small."""
    from memrt.memory.offload.bandwidth import _MIN_PROBE_BYTES, _PROBE_BYTES, _probe_size

    assert _probe_size(str(tmp_path), _PROBE_BYTES) == min(_PROBE_BYTES, folder.room_left(tmp_path) // 8)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        free = shutil.disk_usage(tmp_path).free
        (tmp_path / f"memrt-reserve-{HOST}-{holder.pid}").write_text(str(free - (1 << 20)))
        assert folder.room_left(tmp_path) <= 2 << 20
        assert _probe_size(str(tmp_path), _PROBE_BYTES) == _MIN_PROBE_BYTES
    finally:
        holder.communicate(b"\n", timeout=30)
