"""The benchmarks' --quick modes run from a clean checkout and produce their JSON with same-run ratios.

One slow test per benchmark (the generous timeouts are for a shared, loaded machine). A memrt arm that
raises fails its benchmark (exit 1, a printed FAIL line) and so its test; a SKIP is printed only for a requirement the machine lacks (root, a GPU, a package), named in
the line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], out: Path, timeout: float) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", *args, "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    name = args[0].rsplit(".", 1)[1]
    return json.loads((out / f"{name}.json").read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_memory_frontier_quick(tmp_path):
    """GPT only here: baselines measured, peaks ordered as checkpointing implies."""
    data, out = _run(["benchmarks.memory_frontier", "--workloads", "gpt"], tmp_path, 600)
    assert data["machine"]["cores"] and data["machine"]["torch"]
    rows = {r["arm"]: r for r in data["results"]["gpt"]["rows"]}
    assert rows["none"]["time_vs_none"] == 1.0
    assert rows["every_block"]["peak_bytes"] < rows["none"]["peak_bytes"], rows
    assert rows["every_k=2"]["peak_bytes"] < rows["none"]["peak_bytes"], rows
    assert "SKIP save_on_cpu" in out
    memrt_rows = [r for r in rows.values() if r["memrt"]]
    assert memrt_rows, "no memrt arm was measured"
    assert data["failed"] == [] and "FAIL" not in out
    for r in memrt_rows:
        assert "time_vs_fastest_fitting" in r
    assert (tmp_path / "memory_frontier.png").exists()


@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_collectives_sweep_quick(tmp_path):
    """nccl-tests columns; gloo is the baseline measured in the same run; auto's decision timed (alone: < 1 ms)."""
    data, out = _run(["benchmarks.collectives_sweep", "--impls", "gloo,memrt-auto,memrt-check", "--ops",
                      "all_reduce,broadcast", "--max-size", "64KiB"], tmp_path, 600)
    res = data["nets"][0]["results"]
    for row in res["gloo"]["rows"]:  # nccl-tests' bus factor: 2(n-1)/n for all_reduce, 1 for broadcast
        assert row["vs_gloo"] == 1.0 and row["algbw_GBps"] > 0 and row["busbw_GBps"] == pytest.approx(
            row["algbw_GBps"] * (1.5 if row["op"] == "all_reduce" else 1.0))
    assert "memrt-auto" in res and res["memrt-auto"]["rows"], "the memrt arm was not measured"
    # the auto check: flat, hier and auto interleaved in one process, auto's pick read from its comm log
    checks = data["nets"][0]["auto_check"]
    assert {(c["op"], c["size"]) for c in checks} == {(op, s) for op in ("all_reduce", "broadcast")
                                                      for s in (1024, 4096, 16384, 65536)}
    for c in checks:
        assert c["source"] == "interleaved" and c["auto_chose"] in ("flat", "hier"), c
        assert c["flat_s"] > 0 and c["hier_s"] > 0 and c["auto_s"] > 0
        # the decomposed bound: the pick's paired ratio and auto's decision cost, measured
        assert c["decision_s"] is not None and 0 <= c["decision_s"] < 1e-3, c
        low, high = c["pick_ci95"]
        assert low <= c["pick_over_other"] <= high and c["bound_ci95_high"] >= max(1.0, high), c
    assert "(interleaved)" in out and "decomposed (auto = its chosen algorithm" in out
    assert data["failed"] == [] and "FAIL" not in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_end_to_end_quick(tmp_path):
    """Unchanged script, stock vs MEMRT=1 (exact mode trains to the same loss)."""
    data, out = _run(["benchmarks.end_to_end", "--arms", "stock,memrt", "--steps", "6"], tmp_path, 600)
    stock = data["results"]["stock"]
    assert stock["tokens_per_s"] > 0 and stock["final_loss"] > 0
    m = data["results"]["memrt"]
    assert m["memrt_banner"], "MEMRT=1 did not switch memrt on in the unchanged script"
    assert m["final_loss"] == pytest.approx(stock["final_loss"], rel=1e-5)
    assert data["failed"] == [] and "memrt" not in data["skipped"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_zoo_quick(tmp_path):
    """transformers models: outside peak / budget and time vs the fastest fitting reference per row."""
    data, out = _run(["benchmarks.model_zoo"], tmp_path, 900)
    rows = data["rows"]
    assert {r["model"] for r in rows} == {"gpt2"} and len(rows) == 3, rows
    for r in rows:
        assert "error" not in r, r
        assert r["bitwise"] is True, r
        assert r["peak_over_budget"] > 0 and r["time_ratio"] is not None and r["fastest_fitting"], r
    assert "outside peak" in out and "time vs it" in out and data["failed"] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dynamic_shapes_quick(tmp_path):
    # varying input shapes: every step under the budget, bitwise stock, one profile per bucket; timed arms ran
    data, out = _run(["benchmarks.dynamic_shapes"], tmp_path, 800)
    r = data["result"]
    assert data["failed"] == [] and "FAIL memrt" not in out, out[-3000:]
    assert r["steps_over_budget"] == [] and r["max_peak_bytes"] <= r["budget_bytes"], r
    assert r["bitwise"] is True
    assert len(r["profiled"]) <= len(r["buckets"]), r["profiled"]
    med = r["median_job_seconds"]
    assert set(med) == {"stock", "fixed plan", "memrt"} and r["memrt_vs_fixed"] > 0
    assert "memrt / fixed plan =" in out


@pytest.mark.alone  # its CPU caps are checked against an uncapped rank's speed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixed_cluster_job_quick(tmp_path):
    # the unchanged DDP job's scenario runs end to end: standalone speeds, stock, MEMRT=1, the homogeneous reference
    # and the split references (stock's job is its split's reference bitwise: the reference forms gradients as DDP does)
    data, out = _run(["benchmarks.mixed_cluster", "--scenario", "pair"], tmp_path, 500)
    (job,) = data["jobs"]
    assert job["scenario"] == "pair" and job["bound_samples_per_s"] > 0 and job["memrt_over_stock"] > 0
    assert job["homogeneous_caps"] == [0.75, 0.75] and len(job["homogeneous_bound_runs"]) == 1, job
    assert 0 < job["homogeneous_stock_over_bound"] and "homogeneous:" in out
    assert job["max_param_diff_stock_vs_its_reference"] == 0.0, job
    assert job["loss_rel_diff"] <= 0.01 and "split refs:" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slow_link_sync_quick(tmp_path):
    # the learning benchmark of MEMRT_SYNC=diloco: real text, held-out eval, torch's post-local SGD in the same run
    data, out = _run(["benchmarks.slow_link_sync", "--arms", "stock,post-local-sgd-6,diloco-3"], tmp_path, 500)
    res = data["results"]
    assert set(res) == {"stock", "post-local-sgd-6", "diloco-3"} and data["failed"] == [], out[-2000:]
    for name, r in res.items():
        assert r["steps"] == 12 and r["tokens_per_s"] > 0 and r["finite"], (name, r)
        assert [p[0] for p in r["curve"]] == [0, 6, 12], r["curve"]  # eval at the start, every 6 steps, the end
        assert r["curve"][0][3] == res["stock"]["curve"][0][3]  # the same initial model and eval windows
    assert res["stock"]["vs_stock"] == 1.0 and res["stock"]["loss_vs_stock"] == 0.0
    assert res["diloco-3"]["sync_line"] and "12 inner steps, 4 outer steps" in res["diloco-3"]["sync_line"]
    assert res["diloco-3"]["final_eval_loss"] != res["stock"]["final_eval_loss"]  # another algorithm
    assert (tmp_path / "slow_link_sync.png").exists()
