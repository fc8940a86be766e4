"""The examples run briefly, as their docstrings launch them, stock and under ``MEMRT=1``.

HF Trainer (GPT-2), accelerate (Llama, gradient accumulation), a mixed-cluster DDP job on uneven nodes with
a slow rank, the ``mpiexec`` launch of an unchanged DDP script, and the Python API (``memrt.auto`` and
``memrt.comm``). Each ``MEMRT=1`` run must show memrt in the path (one banner, memrt's process group
carrying DDP, collectives in the comm log); the Trainer and accelerate jobs end with the stock loss.
(examples/fsdp2_compile_train.py: tests/test_llm_examples.py; examples/activation_unchanged_ddp.py under
torchrun: tests/test_activation_demo.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memrt.testing import run_mpi, venv_bin

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent.parent / "examples"
BANNER = "memrt 0.1.0 on |"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", MEMRT_REPORT_DIR=str(tmp_path / "report"))
    env.update(extra)
    return env


def _torchrun(tmp_path: Path, script: str, ranks: int, *args: str, **extra: str) -> str:
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", str(ranks), str(EXAMPLES / script), *args]
    try:
        proc = subprocess.run(argv, env=_env(tmp_path, **extra), cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(argv)} hung:\n{exc.stdout}\n{exc.stderr}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    return text


def _reports(tmp_path: Path, ranks: int) -> list[dict]:
    folder = tmp_path / "report"
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def _loss(text: str) -> float:
    (value,) = re.findall(r"final loss ([0-9.]+)", text)
    return float(value)


def _through_memrt(text: str, reports: list[dict]) -> None:
    assert text.count(BANNER) == 1 and "continuing without memrt" not in text, text[-3000:]
    for rank, data in enumerate(reports):
        models = data["meta"]["activation"]["models"]
        assert any(m.get("comm_hook") == "memrt.comm process group (no hook needed)" for m in models), (rank, models)
        assert any(c["op"] == "all_reduce" for c in data["comm"]), (rank, "no all-reduce in the comm log")


@pytest.mark.parametrize("script, args", [
    ("hf_trainer_lm.py", ("--steps", "6", "--seq", "64", "--out", "trainer")),
    ("accelerate_train.py", ("--steps", "4", "--seq", "32")),
])
def test_framework_examples_keep_the_stock_loss_under_memrt(tmp_path, script, args):
    (tmp_path / "stock").mkdir()
    (tmp_path / "memrt").mkdir()
    stock = _torchrun(tmp_path / "stock", script, 2, *args)
    mine = _torchrun(tmp_path / "memrt", script, 2, *args, MEMRT="1")
    _through_memrt(mine, _reports(tmp_path / "memrt", 2))
    # equal ranks: memrt keeps stock's split; one node: the flat all-reduce sums as gloo does
    assert _loss(mine) == _loss(stock), (stock[-1500:], mine[-1500:])


def test_mixed_cluster_example_balances_a_slow_rank_on_uneven_nodes(tmp_path):
    text = _torchrun(tmp_path, "mixed_cluster_ddp.py", 3, "--epochs", "2", "--samples", "2304", "--slow", "2=0.002",
                     MEMRT="1", MEMRT_TOPOLOGY="0,1;2")
    reports = _reports(tmp_path, 3)
    _through_memrt(text, reports)
    assert "memrt: balance (auto): shares" in text, text[-3000:]
    shares = reports[0]["meta"]["activation"]["balance"]["shares"]
    assert shares[2] < shares[0] and shares[2] < shares[1], shares
    grads = [c for c in reports[2]["comm"] if c["op"] == "all_reduce" and c["nbytes"] > 1024]
    assert grads and all(c["tier_bytes"].get("inter", 0) > 0 for c in grads)  # rank 2 is alone on node 1
    assert re.search(r"samples/s over 3 ranks, final loss [0-9.]+", text)


def test_mpiexec_launch_of_an_unchanged_script(tmp_path):
    if venv_bin("mpiexec") is None:
        pytest.fail("mpiexec not found: the test extra installs mpich")
    proc = run_mpi([sys.executable, str(EXAMPLES / "activation_unchanged_ddp.py"), "--steps", "2"], 2,
                   env=_env(tmp_path, MEMRT="1"), timeout=240, cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    _through_memrt(text, _reports(tmp_path, 2))


def test_python_api_example(tmp_path):
    text = _torchrun(tmp_path, "python_api.py", 2, "--steps", "4", MEMRT_TOPOLOGY="0;1")
    assert "2 node(s), 2 ranks; all_reduce -> [3.0, 3.0, 3.0, 3.0]" in text, text[-3000:]
    assert re.search(r"loss [0-9.]+\n", text) and "budget" in text, text[-3000:]
    assert "torch.compile graph" not in text, text[-3000:]  # an eager model: no word of compiled fallbacks
