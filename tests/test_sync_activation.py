"""MEMRT_SYNC=diloco in an unchanged DDP job under MEMRT=1 (torchrun, 4 gloo ranks, nodes from MEMRT_TOPOLOGY).

- 2 nodes x 2 ranks: the job's optimizer steps node replicas, an outer step every MEMRT_SYNC_EVERY steps
  and a last one at destroy_process_group: every rank ends with the same model, which differs from the
  exact run's; the summary and the per-rank report state the mode, H, outer steps and bytes.
- exit without destroy_process_group: the last outer step runs at exit (the report counts it).
- one node: MEMRT_SYNC=diloco is MEMRT_SYNC=exact, bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from memrt.testing import venv_bin

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "sync_ddp_job.py"
STEPS, EVERY = 7, 3


def _run(tmp: Path, name: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full.update(OMP_NUM_THREADS="1", MEMRT="1", MEMRT_REPORT_DIR=str(tmp / name / "report"),
                XDG_CACHE_HOME=str(tmp / "cache"), **env)
    out = tmp / name / "params"
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "4", str(SCRIPT), "--steps", str(STEPS),
            "--out", str(out), *args]
    try:
        proc = subprocess.run(argv, env=full, cwd=tmp, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} hung:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    import torch

    params = [torch.load(out / f"rank{r}.pt") for r in range(4)] if out.exists() else []
    return proc, params


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reports(tmp: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text())["meta"]["activation"]
            for p in sorted((tmp / name / "report").glob("rank*.json"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync")
    two_nodes = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_SYNC_EVERY": str(EVERY)}
    return tmp, {
        "diloco": _run(tmp, "diloco", MEMRT_SYNC="diloco", **two_nodes),
        "exit": _run(tmp, "exit", "--no-destroy", MEMRT_SYNC="diloco", **two_nodes),
        "one_node_diloco": _run(tmp, "one_node_diloco", MEMRT_SYNC="diloco"),
        "one_node_exact": _run(tmp, "one_node_exact"),
    }


def test_two_nodes_end_with_one_model_after_the_last_outer_step(runs):
    tmp, done = runs
    proc, params = done["diloco"]
    assert all(_equal(params[0], p) for p in params[1:])
    assert not _equal(params[0], done["one_node_exact"][1][0])  # another algorithm: not the exact run's model
    sync_lines = [line for line in proc.stderr.splitlines() if line.startswith("memrt: sync diloco")]
    assert len(sync_lines) == 1, proc.stderr[-3000:]
    # 7 inner steps, outer steps after 3 and 6, and the last at destroy_process_group
    assert f"every {EVERY} steps across 2 nodes: {STEPS} inner steps, 3 outer steps" in sync_lines[0]
    reports = _reports(tmp, "diloco")
    assert len(reports) == 4
    for act in reports:
        (s,) = act["sync"]
        numel = sum(v.numel() for v in params[0].values())
        assert (s["outer_steps"], s["every"], s["nodes"], s["outer_bytes_per_step"]) == (3, EVERY, 2, 4 * numel)
        assert s["outer_bytes_total"] == 3 * 4 * numel
        assert s["host_bytes"] >= 2 * 4 * numel  # anchor and momentum, float32
        assert act["models"][0]["comm_hook"].startswith("memrt.sync")
        assert act["models"][0]["grads_via"] == "memrt.sync"  # recorded where the sync was attached


def test_the_last_outer_step_runs_at_exit_without_destroy(runs):
    tmp, done = runs
    proc, _params = done["exit"]
    reports = _reports(tmp, "exit")
    assert [act["sync"][0]["outer_steps"] for act in reports] == [3] * 4, proc.stderr[-3000:]


def test_one_node_diloco_is_exact_bitwise(runs):
    tmp, done = runs
    diloco, exact = done["one_node_diloco"][1], done["one_node_exact"][1]
    assert all(_equal(a, b) for a, b in zip(diloco, exact)) and len(diloco) == 4
    assert all(act["sync"] == [] for act in _reports(tmp, "one_node_diloco"))
