"""``MEMRT=1`` alone (no budget, no other setting) on an unchanged 2-rank DDP job records its collectives.

tests/scripts/ddp_train.py under ``MEMRT=1 torchrun``: DDP's gradient buckets go through memrt's process
group (no hook), whose flat path hands DDP a work that records on completion. Every bucket reduction must land
in the comm log: per rank, the bytes recorded per step equal the model's gradient bytes, and
``memrt report`` shows an algbw/busbw row per collective size, with nccl-tests' maths.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from memrt.testing import venv_bin

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
STEPS = 3

pytestmark = pytest.mark.slow


def test_memrt_on_alone_records_every_ddp_collective(tmp_path):
    from memrt.profiling.comm_log import busbw_factor

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MEMRT="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS),
            "--out", "params.pt"]
    try:
        proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the MEMRT=1 job hung:\n{exc.stderr}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (run,) = list((tmp_path / "memrt-report").iterdir())
    ranks = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]

    sizes: set[int] = set()
    for rank, data in enumerate(ranks):
        (model,) = data["meta"]["activation"]["models"]
        assert model["comm_hook"].startswith("memrt.comm"), model
        assert data["comm"], f"rank {rank}: MEMRT=1 recorded no collective"
        comm = [c for c in data["comm"] if c["op"] == "all_reduce"]
        # DDP's own collectives (parameter shapes and module states at construction, the rebuilt bucket order
        # after step 1) go through memrt's process group and are recorded too
        other = [c for c in data["comm"] if c["op"] != "all_reduce"]
        assert other and {c["op"] for c in other} <= {"broadcast", "all_gather"}, other
        assert {(c["op"], c["algorithm"], c["group_size"], c["dtype"]) for c in comm} == {("all_reduce", "flat", 2,
                                                                                             "float32")}
        # every gradient byte of every step went through a recorded collective
        assert sum(c["nbytes"] for c in comm) == STEPS * 4 * model["parameters"], (rank, comm)
        per_size = Counter(c["nbytes"] for c in comm)
        assert set(per_size.values()) == {STEPS}, per_size  # each bucket once per step
        assert all(c["seconds"] > 0 and c["redop"] == "sum" for c in comm)
        assert sum(c["tier_bytes"]["intra"] for c in comm) > 0  # one node: the ring stays inside it
        sizes |= set(per_size)

    report = subprocess.run([venv_bin("memrt"), "report", str(run)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "# all_reduce  algorithm=flat  ranks=2" in report.stdout and "busbw(GB/s)" in report.stdout
    rows = [r for r in json.loads((run / "report.json").read_text())["comm"]["rows"] if r["op"] == "all_reduce"]
    assert sorted(r["size_bytes"] for r in rows) == sorted(sizes), rows  # one row per collective size
    for r in rows:
        assert r["calls"] == 2 * STEPS and r["ranks"] == 2 and r["algbw_gbps"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor("all_reduce", 2))
        assert f"{r['size_bytes']:>12d}" in report.stdout
