"""examples/fsdp2_compile_train.py (an unchanged FSDP2 script) runs under torchrun with and without MEMRT=1.

4 ranks, two faked nodes (MEMRT_TOPOLOGY), exact collectives (MEMRT_COMM=flat), a budget that makes
memrt recompute some blocks, eager and with each block compiled (``--compile``): one banner, the gathered final
state bitwise equal to the stock run, FSDP2's
all-gathers and reduce-scatters in every rank's comm log (the ranks whose ring neighbour is on the other
node on the inter tier), and the model planned under the budget on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from memrt.testing import venv_bin

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parent.parent / "examples" / "fsdp2_compile_train.py"
BANNER = "memrt 0.1.0 on |"
BUDGET = 12_000_000
"""Between the example's floor (~9.1 MB: every block recomputed) and its keep-all peak (~15.2 MB)."""


def _run(tmp_path: Path, out: str, *flags: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "4", str(EXAMPLE), "--steps", "3", "--out", out,
            *flags]
    try:
        proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} hung:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_blocks"])
def test_fsdp2_example_unchanged_under_memrt(tmp_path, compiled):
    import torch

    if compiled and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor's CPU code generation needs a C++ compiler (apt-get install g++)")
    flags = ("--compile",) if compiled else ()
    _run(tmp_path, "stock.pt", *flags)
    report = tmp_path / "report"
    proc = _run(tmp_path, "memrt.pt", *flags, MEMRT="1", MEMRT_TOPOLOGY="0,1;2,3", MEMRT_COMM="flat",
                MEMRT_BUDGET=str(BUDGET), MEMRT_REPORT_DIR=str(report))
    text = proc.stdout + proc.stderr
    assert text.count(BANNER) == 1 and "backend memrt" in text, text[-3000:]
    assert "continuing without memrt" not in text, text[-3000:]
    stock, mine = torch.load(tmp_path / "stock.pt"), torch.load(tmp_path / "memrt.pt")
    assert stock.keys() == mine.keys() and all(torch.equal(stock[k], mine[k]) for k in stock)
    for rank in range(4):
        data = json.loads((report / f"rank{rank}.json").read_text())
        root = [m for m in data["meta"]["activation"]["models"] if m["kind"] == "fsdp2"][-1]
        assert root["comm_hook"] == "memrt process group" and root["memory"].startswith("planned"), root
        tier = "inter" if rank in (1, 3) else "intra"
        for op in ("all_gather", "reduce_scatter"):
            recs = [c for c in data["comm"] if c["op"] == op]
            assert recs and all(c["tier_bytes"][tier] > 0 for c in recs), (rank, op)
        (plan,) = data["plans"][-1:]
        assert plan["measured_peak_bytes"] is not None and plan["measured_peak_bytes"] <= BUDGET, plan
        assert any(u["action"] == "recompute" for u in plan["units"]), plan
