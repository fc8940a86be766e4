"""``MEMRT=1`` without ``MEMRT_BUDGET``: fit the device (memrt.memory.fit, memrt.activation.budget).

On a GPU the budget is the memory this process can use when memrt attaches (free + its own reserved) less the
margin (the larger of 5% and 512 MiB); on a CPU there is no plan. The test-only ``MEMRT_TEST_DEVICE_FREE``
stands in for the free memory on any device, so the CPU runs here exercise the GPU's behaviour:

- one unchanged single-process job (tests/scripts/single_jobs.py ``loop``: TinyGPT, dropout, keep-all peak
  about 1.6 MiB), run at the same time without memrt (the reference) and under ``MEMRT=1`` with a large free
  figure (keep-all plan), a figure below the keep-all peak (a plan that recomputes, measured peak <= budget),
  a figure below the floor (the planner's error, naming the device's free memory and MEMRT_BUDGET), and
  none (the single-process "no memory plan" line); every run's parameters bitwise equal to the reference;
- a 2-rank DDP job on CPU without a budget: the exit summary's "no memory plan" line;
- units: the margin arithmetic, the figures from ``torch.cuda.mem_get_info``, the setting, the banner and
  summary lines, the error's wording;
- on a GPU (``gpu`` marker, benchmarks/gpu_check.sh): the real figures and a small job's keep-all plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _script_runs import ScriptRuns
from memrt.activation.banner import format_banner
from memrt.activation.budget import CPU_NO_PLAN, UNSET, banner_value, budget_lines, explain_error, model_budget
from memrt.config import load_config
from memrt.errors import BudgetError, ConfigError
from memrt.memory.fit import MARGIN_FLOOR_BYTES, DeviceFit, device_fit, margin_bytes

SCRIPTS = Path(__file__).parent / "scripts"
LOOP = [str(SCRIPTS / "single_jobs.py"), "loop", "--steps", "5"]
"""5 steps: profiled at 1, planned at 2, certified (and re-planned once if over) by 5."""
GiB, MiB, KiB = 2**30, 2**20, 2**10
TIGHT = 1500 * KiB
"""Under the loop's keep-everything peak (about 1.6 MiB), over its floor: some blocks recomputed."""
BANNER = "memrt 0.1.0 on |"

RUNS: dict[str, dict[str, str]] = {
    "stock": {},
    "large": {"MEMRT": "1", "MEMRT_TEST_DEVICE_FREE": "4GiB"},
    # the floor of the margin decides below 10 GiB: the budget is exactly the figure less 512 MiB
    "tight": {"MEMRT": "1", "MEMRT_TEST_DEVICE_FREE": str(MARGIN_FLOOR_BYTES + TIGHT), "MEMRT_OFFLOAD": "none"},
    "floor": {"MEMRT": "1", "MEMRT_TEST_DEVICE_FREE": str(MARGIN_FLOOR_BYTES + 64 * KiB), "MEMRT_OFFLOAD": "none"},
    "unset": {"MEMRT": "1"},
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _ddp(folder: Path) -> str:
    """A 2-rank DDP job on CPU under MEMRT=1 without a budget: rank 0's output."""
    from memrt.testing.launch import launch_ranks

    folder.mkdir()
    results = launch_ranks(["python", str(SCRIPTS / "ddp_train.py"), "--steps", "3", "--out",
                            str(folder / "params.pt")], ranks_per_node=[2], timeout_s=180,
                           env={"MEMRT": "1", "MEMRT_REPORT_DIR": str(folder / "report"), "OMP_NUM_THREADS": "1"})
    return results[0].stderr


class Runs(ScriptRuns):
    """The single-process runs of :data:`RUNS` (started together) and one 2-rank DDP job, run while they do."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, {name: (LOOP, settings) for name, settings in RUNS.items()}, _env, timeout=180)
        self.ddp = _ddp(root / "ddp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("fit"))
    yield r
    r.close()


def _memrt_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("memrt")]


def _report(folder: Path) -> dict:
    (run,) = list((folder / "memrt-report").iterdir())
    return json.loads((run / "rank0.json").read_text())["meta"]["activation"]


def _same_as_stock(runs: Runs, name: str) -> None:
    mine = torch.load(runs.get(name)[1] / "params.pt")
    stock = torch.load(runs.get("stock")[1] / "params.pt")
    assert mine.keys() == stock.keys()
    for k in mine:
        assert torch.equal(mine[k], stock[k]), f"{name}: {k} differs from the run without memrt"


def _fit_of(name: str) -> DeviceFit:
    return DeviceFit(device="cpu", free_bytes=load_config(RUNS[name]).test_device_free, test_figure=True)


def _budget_stated(text: str, fit: DeviceFit) -> None:
    """The banner's MEMRT_BUDGET line and the summary's budget line state the fit-the-device figures."""
    lines = _memrt_lines(text)
    assert text.count(BANNER) == 1, text[-3000:]
    (line,) = [line for line in lines if line.split()[1:2] == ["MEMRT_BUDGET"]]
    assert line.split()[-1] == "default" and fit.describe() in line, line
    assert f"memrt: budget  {fit.describe()}" in lines, text[-3000:]
    assert fit.describe().startswith("fit the device: ") and "(MEMRT_TEST_DEVICE_FREE)" in fit.describe()


@pytest.mark.slow
def test_a_job_that_fits_keeps_everything(runs):
    text, folder = runs.get("large")
    fit = _fit_of("large")
    assert fit.budget_bytes == 4 * GiB - 512 * MiB
    _budget_stated(text, fit)
    act = _report(folder)
    (plan,) = act["plans"]
    assert {u["action"] for u in plan["units"]} == {"keep"}, plan
    assert plan["budget_bytes"] == act["budget_bytes"] == fit.budget_bytes
    assert act["failures"] == [] and act["models"][0]["budget_fit"]["budget_bytes"] == fit.budget_bytes
    line = next(line for line in _memrt_lines(text) if line.startswith("memrt: model 1"))
    assert "3 kept" in line and "= fit the device" in line, line
    _same_as_stock(runs, "large")


@pytest.mark.slow
def test_a_job_over_the_free_memory_gets_a_plan_that_fits(runs):
    text, folder = runs.get("tight")
    fit = _fit_of("tight")
    assert fit.budget_bytes == TIGHT
    _budget_stated(text, fit)
    act = _report(folder)
    (plan,) = act["plans"]
    assert "recompute" in {u["action"] for u in plan["units"]}, plan
    assert plan["budget_bytes"] == TIGHT and act["failures"] == []
    assert plan["measured_peak_bytes"] is not None and plan["measured_peak_bytes"] <= TIGHT, plan
    _same_as_stock(runs, "tight")


@pytest.mark.slow
def test_a_floor_over_the_free_memory_is_the_budget_error_naming_its_source(runs):
    text, folder = runs.get("floor")
    fit = _fit_of("floor")
    assert fit.budget_bytes == 64 * KiB
    (warning,) = [line for line in text.splitlines() if "BudgetError" in line]
    assert "continuing without memrt" in warning, warning
    for needle in ("no MEMRT_BUDGET, so the budget came from the device's free memory", fit.describe(),
                   "is infeasible: the smallest feasible budget is", "set MEMRT_BUDGET (e.g. MEMRT_BUDGET="):
        assert needle in warning, (needle, warning)
    assert len(_report(folder)["failures"]) == 1
    _same_as_stock(runs, "floor")  # memrt stepped aside: the job went on as without it


@pytest.mark.slow
def test_on_cpu_without_a_budget_no_plan_is_said_in_one_line(runs):
    text, folder = runs.get("unset")
    assert _memrt_lines(text) == ["memrt: single process, trained TinyGPT (AdamW, 0.04M parameters, cpu), no "
                                  "MEMRT_BUDGET on CPU: no memory plan (set MEMRT_BUDGET=60% to plan)"], text[-3000:]
    assert not (folder / "memrt-report").exists()
    _same_as_stock(runs, "unset")
    # a DDP job on CPU: its exit summary says the same in one line; the banner names the rule
    lines = _memrt_lines(runs.ddp)
    assert f"memrt: budget  {CPU_NO_PLAN}" in lines, runs.ddp[-3000:]
    (line,) = [line for line in lines if line.split()[1:2] == ["MEMRT_BUDGET"]]
    assert UNSET in line, line


# ------------------------------------------------------------------------------------------------------ units


def test_margin_is_five_percent_or_512_mib_whichever_is_larger():
    assert margin_bytes(0) == margin_bytes(GiB) == MARGIN_FLOOR_BYTES == 512 * MiB
    assert margin_bytes(10 * GiB) == 512 * MiB  # where the two meet
    assert margin_bytes(80 * GiB) == 4 * GiB
    assert margin_bytes(20 * GiB + 1) == GiB + 1  # 5% rounded up: never less held back than stated
    with pytest.raises(ValueError, match="usable_bytes"):
        margin_bytes(-1)
    big = DeviceFit(device="cuda:0", free_bytes=70 * GiB, reserved_bytes=10 * GiB)
    assert big.usable_bytes == 80 * GiB and big.budget_bytes == 76 * GiB
    assert big.describe() == "fit the device: 80.00 GiB free, 5% margin -> 76.00 GiB"
    small = DeviceFit(device="cuda:0", free_bytes=2 * GiB)
    assert small.budget_bytes == 2 * GiB - 512 * MiB
    assert small.describe() == "fit the device: 2.00 GiB free, 512.00 MiB margin -> 1.50 GiB"
    assert DeviceFit(device="cuda:0", free_bytes=100 * MiB).budget_bytes == 1  # no room: no step fits


def test_device_fit_counts_free_and_this_process_reserved_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: calls.append(str(d)) or (30 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * GiB)
    fit = device_fit("cuda:1")
    assert calls == ["cuda:1"] and fit.usable_bytes == 32 * GiB and fit.budget_bytes == 32 * GiB - 1717986919
    assert fit.margin_bytes == -(-32 * GiB * 5 // 100)
    assert device_fit("cpu") is None  # nothing to fit
    test = device_fit("cpu", test_free_bytes=3 * GiB)
    assert test.test_figure and test.budget_bytes == 3 * GiB - 512 * MiB and calls == ["cuda:1"]


def test_the_test_figure_is_a_test_only_setting_that_changes_nothing_unset():
    unset = load_config({"MEMRT": "1"})
    assert unset.test_device_free is None and "MEMRT_TEST_DEVICE_FREE" not in unset.effective()
    cfg = load_config({"MEMRT": "1", "MEMRT_TEST_DEVICE_FREE": "600MB"})
    assert cfg.test_device_free == 600_000_000
    assert cfg.effective()["MEMRT_TEST_DEVICE_FREE"] == {"value": 600_000_000, "source": "environment"}
    with pytest.raises(ConfigError, match="MEMRT_TEST_DEVICE_FREE"):
        load_config({"MEMRT_TEST_DEVICE_FREE": "lots"})
    text = format_banner(config=cfg, launcher="single", world_size=1, nodes=((0,),), nodes_source="single process",
                         backend="none", run_id="r", report_dir=Path("r"), budget="fit the device: x")
    (line,) = [line for line in text.splitlines() if "MEMRT_TEST_DEVICE_FREE" in line]
    assert "(test only)" in line and line.split()[-1] == "environment", line
    assert "MEMRT_TEST_DEVICE_FREE" not in format_banner(
        config=unset, launcher="single", world_size=1, nodes=((0,),), nodes_source="single process", backend="none",
        run_id="r", report_dir=Path("r"))


def test_model_budget_per_setting():
    def session(**env: str) -> SimpleNamespace:
        return SimpleNamespace(config=load_config({"MEMRT": "1", **env}), fits={})

    given = session(MEMRT_BUDGET="60%")
    entry: dict = {}
    assert model_budget(given, "cuda:0", entry) == (given.config.budget, None) and entry == {}
    assert banner_value(given, "cuda:0") is None  # the banner shows MEMRT_BUDGET itself
    cpu = session()
    assert model_budget(cpu, "cpu", entry) == (None, None) and entry["budget_source"] == CPU_NO_PLAN
    assert banner_value(cpu) == UNSET and banner_value(cpu, "cpu") == CPU_NO_PLAN
    test = session(MEMRT_TEST_DEVICE_FREE="1GiB")
    entry = {}
    budget, fit = model_budget(test, "cpu", entry)
    assert budget == fit.budget_bytes == 512 * MiB and entry["budget_source"] == fit.describe()
    assert model_budget(test, "cpu", {})[1] is fit  # measured once per device and session
    assert banner_value(test) == fit.describe()


def test_the_error_names_the_device_free_memory_and_how_to_set_a_budget():
    fit = DeviceFit(device="cuda:0", free_bytes=600 * MiB)
    exc = BudgetError(fit.budget_bytes, 300 * MiB, "every unit recomputed", keep_all_bytes=400 * MiB)
    told = explain_error(exc, fit)
    assert isinstance(told, BudgetError) and told.min_feasible_bytes == 300 * MiB and told.keep_all_bytes == 400 * MiB
    text = str(told)
    assert f"came from the device's free memory ({fit.describe()})" in text
    assert f"MEMRT_BUDGET={300 * MiB}" in text and "every unit recomputed" in text
    assert explain_error(exc, None) is exc and "raise MEMRT_BUDGET" in str(exc)
    other = RuntimeError("x")
    assert explain_error(other, fit) is other


def test_summary_budget_lines():
    same = [{"rank": 0, "budget_source": "a"}, {"rank": 1, "budget_source": "a"}]
    assert budget_lines(same) == ["memrt: budget  a"]
    assert budget_lines([{"rank": 0, "budget_source": "a"}, {"rank": 1, "budget_source": "b"}]) == [
        "memrt: budget  rank 0: a", "memrt: budget  rank 1: b"]
    assert budget_lines([{"rank": 0, "budget_source": None}]) == []


@pytest.mark.gpu
def test_on_cuda_the_budget_is_the_free_memory_less_the_margin_and_a_small_job_keeps_everything():
    """The GPU path (benchmarks/gpu_check.sh's pytest_gpu step): the figures come from the driver and the
    allocator, this process's reserved memory counts as usable, and a job that fits gets the keep-all plan."""
    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    dev = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)  # reserved by this process: usable by it
    free, total = torch.cuda.mem_get_info(dev)
    session = SimpleNamespace(config=load_config({"MEMRT": "1"}), fits={})
    entry: dict = {}
    budget, fit = model_budget(session, str(dev), entry)
    assert fit.device == str(dev) and not fit.test_figure and fit.reserved_bytes >= held.numel()
    assert abs(fit.free_bytes - free) <= 64 * MiB and fit.usable_bytes <= total
    assert budget == fit.budget_bytes == fit.usable_bytes - margin_bytes(fit.usable_bytes)
    assert entry["budget_source"].startswith("fit the device: ") and "(MEMRT_TEST_DEVICE_FREE)" not in fit.describe()
    cfg = GPTConfig(n_layer=3, d_model=64, n_head=2, seq_len=64, vocab_size=128, dropout=0.1)
    model = GPT(cfg).to(dev)
    memrt.auto(model, budget, offload="none", cache=PlanCache())
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            x, y = gpt_batch(cfg, 4, seed=step)
            opt.zero_grad()
            lm_loss(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
        plan = memrt.plan_of(model)
        assert {u.action for u in plan.units} == {"keep"}, str(plan)
        assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    finally:
        memrt.disable(model)
