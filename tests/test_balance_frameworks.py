"""MEMRT=1 balances an unchanged HF Trainer job and an unchanged accelerate script (tests/scripts/).

Rank 1 is slowed by a sleep per sample in forward (the scripts' BALANCE_JOB_DELAY; no root needed). Each
framework: one stock launch and one MEMRT=1 launch; the MEMRT=1 one must end with uneven shares that
favour the fast rank (in its batch sizes and in both rank reports), the same final parameters as stock
(rtol 1e-4) and the same sample set at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from memrt.testing import venv_bin

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SLOW = {"BALANCE_JOB_DELAY": "1=0.0008"}

pytestmark = pytest.mark.slow


def _launch(tmp: Path, script: str, name: str, env: dict[str, str], *args: str) -> dict:
    import torch

    full = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRT", "BALANCE_JOB"))
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **SLOW, **env)
    out = tmp / name
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / script), *args,
            "--out", str(out)]
    proc = subprocess.run(argv, env=full, cwd=tmp, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "params": torch.load(f"{out}.params.pt"), "stderr": proc.stderr}


def _balance_reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text())["meta"]["activation"]["balance"] for p in sorted(folder.glob("rank*.json"))]


def _check_balanced(run: dict, folder: Path) -> None:
    import torch

    r0, r1 = run["ranks"]
    assert r0["sizes"][0] == r1["sizes"][0] == 8  # stock split until measured
    assert r0["sizes"][-1] > 8 > r1["sizes"][-1], (r0["sizes"], r1["sizes"])
    assert all(a + b == 16 for a, b in zip(r0["sizes"], r1["sizes"]))
    reports = _balance_reports(folder)
    assert len(reports) == 2 and reports[0]["decisions"] == reports[1]["decisions"]
    assert reports[0]["shares"][0] > reports[0]["shares"][1]
    assert "memrt: balance (auto): shares" in run["stderr"]
    assert isinstance(run["params"][0], torch.Tensor)


def _allclose(a, b) -> bool:
    import torch

    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b))


def test_hf_trainer_job_is_balanced(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    stock = _launch(tmp_path, "hf_trainer_job.py", "stock", {}, "--steps", "36")
    memrt = _launch(tmp_path, "hf_trainer_job.py", "memrt", {"MEMRT": "1", "MEMRT_REPORT_DIR": str(tmp_path / "r")},
                    "--steps", "36")
    _check_balanced(memrt, tmp_path / "r")
    unions = [[sorted(a + b) for a, b in zip(run["ranks"][0]["rows"], run["ranks"][1]["rows"])]
              for run in (memrt, stock)]
    assert unions[0] == unions[1]  # the same samples (fingerprints of their token ids) at every step
    assert _allclose(memrt["params"], stock["params"])


def test_accelerate_script_is_balanced(tmp_path):
    pytest.importorskip("accelerate")
    stock = _launch(tmp_path, "accelerate_job.py", "stock", {}, "--steps", "40")
    memrt = _launch(tmp_path, "accelerate_job.py", "memrt", {"MEMRT": "1", "MEMRT_REPORT_DIR": str(tmp_path / "r")},
                    "--steps", "40")
    _check_balanced(memrt, tmp_path / "r")
    unions = [[sorted(a + b) for a, b in zip(run["ranks"][0]["steps"], run["ranks"][1]["steps"])]
              for run in (memrt, stock)]
    assert unions[0] == unions[1]
    assert _allclose(memrt["params"], stock["params"])
