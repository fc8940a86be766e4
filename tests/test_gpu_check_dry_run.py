"""benchmarks/gpu_check.sh on a machine without CUDA: the dry run gets to the first CUDA step, SKIPs it and every
later one with the reason, never crashes, and writes its JSON and table; a real run there exits non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs for real")


def _run(tmp_path: Path, *args: str, limit: str = "120") -> tuple[subprocess.CompletedProcess, dict, str]:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_LIMIT_S=limit)
    p = subprocess.run(["bash", str(SCRIPT), *args, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=100, cwd=tmp_path)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    return p, data, (tmp_path / "gpu_check.txt").read_text()


def test_dry_run_skips_cuda_steps_with_the_reason(tmp_path):
    p, data, text = _run(tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["name"]: r for r in data["rows"]}
    from benchmarks.gpu_check import STEPS

    assert list(rows) == ["environment", "cuda", "install"] + [name for name, _, _ in STEPS]
    env = rows["environment"]
    assert env["status"] == "PASS" and env["figures"]["torch"] == torch.__version__
    assert env["figures"]["cuda_available"] is False
    assert rows["cuda"]["status"] == "SKIP" and "torch.cuda.is_available() is False" in rows["cuda"]["reason"]
    assert rows["install"]["status"] == "PASS" and "--no-build-isolation" in rows["install"]["figures"]["command"]
    assert "Would install memrt" in rows["install"]["reason"]  # pip's own dry run of the offline install
    assert rows["imports"]["status"] == "PASS"  # a child process imports memrt.comm / memrt.profiling
    for name, _, needs_cuda in STEPS:
        if needs_cuda:
            assert rows[name]["status"] == "SKIP" and "needs CUDA" in rows[name]["reason"], rows[name]
    assert data["status"] == "PASS" and data["dry_run"] is True and data["limit_s"] <= 405
    for name in rows:  # the table has every row with its status
        assert any(line.startswith(name) and rows[name]["status"] in line for line in text.splitlines())


def test_real_run_without_cuda_fails_fast(tmp_path):
    p, data, _ = _run(tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["cuda"]["status"] == "FAIL" and "no CUDA device" in rows["cuda"]["reason"]
    assert rows["install"]["status"] == "SKIP"  # nothing installed on a machine that cannot run the check
    assert data["status"] == "FAIL"


def test_script_limits_fit_the_device_slot():
    text = SCRIPT.read_text()
    assert "GPU_CHECK_LIMIT_S:-390" in text and "--kill-after=5 $((LIMIT + 10))" in text  # <= 420 s hard
    from benchmarks.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--limit", "600", "--out", "/nonexistent-never-created"])


def test_no_python_with_torch_exits_3(tmp_path):
    env = dict(os.environ, PYTHON="/bin/false", PATH="/usr/bin:/bin")
    env.pop("VIRTUAL_ENV", None)
    if subprocess.run(["python3", "-c", "import torch"], env=env, capture_output=True, timeout=60).returncode == 0:
        pytest.skip("the system python3 has torch: the script would use it")
    repo = tmp_path / "repo"  # a checkout without .venv
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "gpu_check.sh").write_text(SCRIPT.read_text())
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    assert p.returncode == 3 and "no python with torch" in p.stderr
    assert json.loads((out / "gpu_check.json").read_text())["status"] == "FAIL"
