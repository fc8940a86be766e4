"""memrt.auto on real model code from transformers: bitwise equal to stock, peak from outside <= budget x 1.10.

Per model (memrt.testing.zoo: GPT-2, Llama, BERT with padding masks, T5, ViT, ConvNeXt), one fresh process
(memrt.testing.zoo_run) trains stock, the model's own checkpointing of every layer, and memrt.auto at 3
budgets between those two peaks (memrt.testing.zoo.budget_fractions; both measured from outside in the
same process), 3 AdamW steps each,
with an empty cache directory and default settings (offload auto). Asserted per budget: the state_dict
after the steps has the same keys and the same bits as stock's; memrt planned something other than keep
where keeping everything does not fit by its count (and nothing else where it does);
the process's peak RSS growth over the arm is at most 1.10 x the budget.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memrt.config import environ
from memrt.testing.zoo import names

pytest.importorskip("transformers", reason='the model zoo needs transformers: pip install "memrt[test]"')

pytestmark = pytest.mark.slow
TOLERANCE = 1.10


def _run_zoo(model: str, tmp_path) -> dict:
    env = {k: v for k, v in environ().items() if not k.startswith("MEMRT")}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    out = tmp_path / f"{model}.json"
    proc = subprocess.run([sys.executable, "-m", "memrt.testing.zoo_run", "--model", model, "--size", "tiny",
                           "--steps", "3", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(700)
@pytest.mark.parametrize("model", names())
def test_zoo_model_bitwise_and_under_budget(model, tmp_path):
    data = _run_zoo(model, tmp_path)
    arms = data["arms"]
    stock = next(a for a in arms if a["arm"] == "none")
    ckpt = next(a for a in arms if a["arm"] == "ckpt1")
    assert ckpt["outside_peak_bytes"] < stock["outside_peak_bytes"], (ckpt, stock)
    memrt_arms = [a for a in arms if a["arm"] == "memrt"]
    assert len(memrt_arms) == 3
    for a in memrt_arms:
        label = f"{model} at budget {a['budget_bytes']} (fraction {a['fraction']})"
        assert "error" not in a, f"{label}: {a.get('error')}"
        assert a["state_keys"] == stock["state_keys"], label
        assert a["state_sha256"] == stock["state_sha256"], f"{label}: state_dict differs from stock"
        if a["plan"]["keep_all_peak_bytes"] > a["budget_bytes"]:  # keeping everything does not fit by memrt's count
            assert any(x != "keep" for x in a["plan"]["actions"]), f"{label}: nothing planned: {a['plan']}"
        else:  # it fits: a free-looking offload must not displace keep
            assert set(a["plan"]["actions"]) == {"keep"}, f"{label}: planned though keeping fits: {a['plan']}"
        assert a["outside_peak_bytes"] <= TOLERANCE * a["budget_bytes"], (
            f"{label}: peak RSS growth {a['outside_peak_bytes']} > {TOLERANCE} x budget; plan {a['plan']}")
