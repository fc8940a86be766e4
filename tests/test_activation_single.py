"""MEMRT=1 on unchanged single-process jobs (no process group, no launcher): memrt finds the model an optimizer
trains and plans it, or says in one line why it did nothing (memrt.activation.single).

Each job script under tests/scripts/ (no memrt import) runs twice as its own process, at the same time: MEMRT
unset (the reference) and MEMRT=1. Checked: one banner, the plan in the summary (units kept / recomputed, budget,
measured peak) and in ``rank0.json``, step 1 as the profiling step, and the final ``state_dict`` bitwise equal to
the reference; where memrt has nothing to act on, exactly one memrt line and no report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _script_runs import ScriptRuns
from memrt.config import load_config

SCRIPTS = Path(__file__).parent / "scripts"
BANNER = "memrt 0.1.0 on |"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMRT") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


LOOP = [str(SCRIPTS / "single_jobs.py"), "loop", "--steps", "5"]
"""5 steps: a plan that certification re-plans (its first measured step over the tight budget) is measured too."""
CANNOT_APPLY = {"MEMRT_COMPRESS": "int8", "MEMRT_BALANCE": "on"}
"""Settings that act on collectives between ranks: nothing to do in one process."""
JOBS: dict[str, tuple[list[str], dict[str, str]]] = {
    "loop stock": (LOOP, {}),
    # under its keep-everything peak (about 1.6 MiB): some blocks recomputed
    "loop tight": (LOOP, {"MEMRT": "1", "MEMRT_BUDGET": "1500KiB", "MEMRT_OFFLOAD": "none", **CANNOT_APPLY}),
    "loop no budget": (LOOP, {"MEMRT": "1"}),
    "loop bad budget": (LOOP, {"MEMRT": "1", "MEMRT_BUDGET": "lots"}),
    "infer": ([str(SCRIPTS / "single_jobs.py"), "infer"], {"MEMRT": "1", **CANNOT_APPLY}),
    "gan stock": ([str(SCRIPTS / "single_jobs.py"), "gan", "--steps", "3"], {}),
    "gan": ([str(SCRIPTS / "single_jobs.py"), "gan", "--steps", "3"], {"MEMRT": "1", "MEMRT_BUDGET": "60%"}),
    "hf stock": ([str(SCRIPTS / "single_hf_trainer.py"), "--steps", "3"], {}),
    "hf": ([str(SCRIPTS / "single_hf_trainer.py"), "--steps", "3"], {"MEMRT": "1", "MEMRT_BUDGET": "60%"}),
    "accelerate stock": ([str(SCRIPTS / "single_accelerate.py"), "--steps", "3"], {}),
    "accelerate": ([str(SCRIPTS / "single_accelerate.py"), "--steps", "3"], {"MEMRT": "1", "MEMRT_BUDGET": "60%"}),
}
"""Every run of this file: started all at once on first use (launches are the expensive part), each in its
own folder; 3 steps (5 for the loop): profiled at 1, planned and measured at 2, certified when 3 begins."""
try:
    import pytorch_lightning  # noqa: F401
except ImportError:
    HAS_LIGHTNING = False
else:
    HAS_LIGHTNING = True
    JOBS["lightning stock"] = ([str(SCRIPTS / "single_lightning.py"), "--steps", "3"], {})
    JOBS["lightning"] = ([str(SCRIPTS / "single_lightning.py"), "--steps", "3"], {"MEMRT": "1", "MEMRT_BUDGET": "60%"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = ScriptRuns(tmp_path_factory.mktemp("single"), JOBS, _env, returncodes={"loop bad budget": 2})
    yield r
    r.close()


def _state(folder: Path) -> dict:
    import torch

    return torch.load(folder / "params.pt")


def _assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the run without memrt"


def _memrt_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("memrt")]


def _report(folder: Path) -> dict:
    (run,) = list((folder / "memrt-report").iterdir())
    (rank0,) = list(run.glob("rank*.json"))
    assert rank0.name == "rank0.json"
    return json.loads(rank0.read_text())["meta"]["activation"]


def _planned_job(runs: Runs, name: str, models: list[str]) -> tuple[str, dict]:
    """The MEMRT=1 run ``name`` against its stock run: banner, summary, report and state; (its output, report)."""
    stock, stock_dir = runs.get(name.split()[0] + " stock")
    mine, mine_dir = runs.get(name)
    assert "memrt" not in stock.replace(str(SCRIPTS), ""), stock[-2000:]
    assert not (stock_dir / "memrt-report").exists()
    assert mine.count(BANNER) == 1, mine[-4000:]
    banner = mine[mine.index(BANNER):].splitlines()[0]
    assert "launcher single" in banner and "1 rank = 1 node x 1 (single process)" in banner, banner
    assert "continuing without memrt" not in mine, mine[-4000:]
    assert "memrt summary" in mine and "1/1 ranks reported" in mine, mine[-4000:]
    _assert_same(_state(mine_dir), _state(stock_dir))
    act = _report(mine_dir)
    assert act["single_process"] is True and act["world_size"] == 1 and act["failures"] == []
    assert [m["module"] for m in act["models"]] == models, act["models"]
    for model in act["models"]:
        # memrt's step hook ran for the job's first training forward: step 1 is the profiling step
        assert model["kind"] == "single" and model["memory"].startswith("planned at step 1"), model
        assert model["grads_via"] == "none", model  # no gradient reduction in one process
    assert len(act["plans"]) == len(models), act["plans"]
    for plan in act["plans"]:  # 3 steps: profiled at 1, planned and measured at 2, certified when 3 begins
        assert plan["measured_peak_bytes"] is not None, plan
    lines = [line for line in _memrt_lines(mine) if line.startswith("memrt: model ")]
    assert len(lines) == len(models), mine[-3000:]
    for name, line in zip(models, lines):
        assert f" {name} (" in line and "units:" in line and "| budget " in line and " measured, " in line, line
    return mine, act


NOTE = ("MEMRT_COMPRESS=int8 and MEMRT_BALANCE=on do nothing in a single process (they act on collectives "
        "between ranks: launch with torchrun or mpiexec and DDP / FSDP to use them)")


@pytest.mark.slow
def test_plain_loop_recomputes_under_a_tight_budget(runs):
    """A plain loop (dropout, an evaluation forward between steps): some blocks recomputed, the same bits as
    without memrt; the settings that act between ranks are named after the summary."""
    mine, act = _planned_job(runs, "loop tight", ["TinyGPT"])
    (plan,) = act["plans"]
    assert "recompute" in {u["action"] for u in plan["units"]}, plan
    assert plan["measured_peak_bytes"] <= plan["budget_bytes"] == 1500 * 1024
    line = next(line for line in _memrt_lines(mine) if line.startswith("memrt: model 1"))
    assert "recomputed" in line and "budget 1.46 MiB" in line, line
    assert _memrt_lines(mine)[-1] == f"memrt: {NOTE}"


@pytest.mark.slow
def test_hf_trainer_in_one_process(runs):
    """HF Trainer calls the model with keyword inputs only: memrt's step hook still sees step 1."""
    mine, _ = _planned_job(runs, "hf", ["GPT2LMHeadModel"])
    assert "(AdamW, " in mine and "kept" in mine and "= 60%" in mine


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIGHTNING, reason="pip install pytorch-lightning")
def test_lightning_on_one_cpu_device(runs):
    _planned_job(runs, "lightning", ["Net"])


@pytest.mark.slow
def test_accelerate_without_a_launcher(runs):
    _planned_job(runs, "accelerate", ["Sequential"])


@pytest.mark.slow
def test_gan_plans_both_models(runs):
    """Two models, two optimizers, the discriminator called three times a step: both planned, same bits."""
    mine, act = _planned_job(runs, "gan", ["Sequential", "Sequential"])
    assert [m["optimizer"] for m in act["models"]] == ["Adam", "Adam"]


@pytest.mark.slow
def test_nothing_to_act_on_says_so_in_one_line(runs):
    """No MEMRT_BUDGET on CPU; a script that trains nothing, with settings that act between ranks: one line at
    exit, no banner, no report, the job's result unchanged."""
    _assert_same(_state(runs.get("loop no budget")[1]), _state(runs.get("loop stock")[1]))
    expected = {
        "loop no budget": "memrt: single process, trained TinyGPT (AdamW, 0.04M parameters, cpu), no MEMRT_BUDGET "
                          "on CPU: no memory plan (set MEMRT_BUDGET=60% to plan)",
        "infer": "memrt: single process, no torch.optim optimizer built (nothing trained): no model to plan "
                 "(memrt plans the model an optimizer trains, or the DDP / FSDP model of a torchrun job); " + NOTE,
    }
    for name, line in expected.items():
        text, folder = runs.get(name)
        assert _memrt_lines(text) == [line], (name, text[-3000:])
        assert not (folder / "memrt-report").exists(), name


@pytest.mark.slow
def test_bad_setting_exits_2_when_the_optimizer_is_built(runs):
    """As the distributed path does at init_process_group: one line, exit 2, before any training step."""
    text, folder = runs.get("loop bad budget")
    assert _memrt_lines(text) == ["memrt: error: MEMRT_BUDGET='lots' is not valid: expected a size: bare integer "
                                  "bytes, or a number with KB/MB/GB/TB (decimal) or KiB/MiB/GiB/TiB (binary) such as "
                                  "500MB or 3GiB, or a share such as 60%"], text[-3000:]
    assert "step 0" not in text and not (folder / "params.pt").exists()


def test_settings_notes_name_only_what_was_given():
    from memrt.activation.single import settings_notes

    assert settings_notes(load_config({"MEMRT": "1", "MEMRT_BUDGET": "60%"})) is None
    assert settings_notes(load_config({"MEMRT": "1", "MEMRT_BALANCE": "off", "MEMRT_COMPRESS": "none"})) is None
    note = settings_notes(load_config({"MEMRT": "1", "MEMRT_TOPOLOGY": "0,1;2,3"}))
    assert note.startswith("MEMRT_TOPOLOGY=0,1;2,3 does nothing in a single process"), note


def test_finder_plans_the_top_most_trained_module_and_runs_its_step_hook_for_the_first_forward(monkeypatch):
    """In process, with the planner replaced by a recorder: the module planned is the top-most one called with
    grad enabled whose parameters an optimizer steps (not a frozen module called before it, not its submodules,
    not nn.DataParallel); the step hook memrt registers runs for that very forward, keyword inputs included;
    the global hook is gone once every optimizer's parameters are covered."""
    import types

    import torch
    import torch.nn as nn

    from memrt.activation import report, session, single, wiring

    calls: list[tuple[str, int, list[str]]] = []

    def fake_plan(_sess, module, entry):
        module.register_forward_pre_hook(lambda m, a, k: calls.append((type(m).__name__, len(a), sorted(k))),
                                         with_kwargs=True)
        entry["memory"] = "planned at step 1 (test)"

    monkeypatch.setattr(session, "_OFF", False)
    monkeypatch.setattr(session, "_SESSION", None)
    monkeypatch.setattr(wiring, "plan_model", fake_plan)
    monkeypatch.setattr(report, "begin_single",
                        lambda config, **_: types.SimpleNamespace(models=[], single=True, clock=None))
    monkeypatch.setattr(single, "_ARMED_PID", os.getpid())  # armed without the atexit line
    monkeypatch.setattr(single, "_CONFIG", load_config({"MEMRT": "1", "MEMRT_BUDGET": "1GiB"}))
    monkeypatch.setenv("MEMRT_AUTOLOAD_ACTIVE", "")  # note_optimizer sets it; monkeypatch removes it afterwards

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

        def forward(self, x, *, scale=1.0):
            return self.body(x) * scale

    try:
        frozen, top, other = nn.Linear(4, 4), Top(), Top()
        opt = torch.optim.SGD(top.parameters(), lr=0.1)
        single.note_optimizer(opt)
        single.note_optimizer(torch.optim.SGD(other.parameters(), lr=0.1))
        assert single._PRE_HANDLE is not None
        x = torch.randn(2, 4)
        with torch.no_grad():
            top(x, scale=3.0)  # not a training forward
        frozen(x)  # owns no optimizer's parameters
        top(x, scale=2.0)
        assert calls == [("Top", 1, ["scale"])], calls  # run once, for this forward, with its keyword input
        top.body(x)
        nn.DataParallel(other)(x)  # on CPU it calls the module it wraps
        assert [f["entry"]["module"] for f in single._FOUND] == ["Top", "Top"]
        assert single._PRE_HANDLE is None, "every optimizer's parameters are covered: the global hook is gone"
        top(x, scale=2.0)
        # DataParallel's module got its own; then torch runs Top's hook itself, once per forward
        assert calls == [("Top", 1, ["scale"]), ("Top", 1, []), ("Top", 1, ["scale"])], calls
    finally:
        single.disarm()
