"""Env activation, in-process and cheap subprocesses: start-up hook cost, exclusions, post-import hook,
failure policy, banner, memrt run's environment and sitecustomize chaining."""

from __future__ import annotations

import importlib
import json
import logging
import os
import site
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memrt.activation import autoload, hooks, install, session
from memrt.activation.banner import describe_nodes, format_banner
from memrt.config import Budget, load_config

REPO = Path(__file__).resolve().parents[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env.update(extra)
    return env


def _pth_path() -> Path:
    for d in site.getsitepackages():
        p = Path(d) / install.PTH_NAME
        if p.is_file():
            return p
    pytest.fail(f"{install.PTH_NAME} is not installed in this interpreter's site-packages: "
                "reinstall memrt (pip install -e .) so setup.py writes it")


def test_startup_files_installed_and_current():
    assert install.autoload_installed(), "memrt-autoload.pth missing or stale: run pip install -e ."
    names = {p.name for p in install.installed_paths()}
    assert {install.PTH_NAME, install.START_NAME, install.STARTUP_MODULE} <= names


def _memrt_modules(code: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_LIST = ("import sys, json; print(json.dumps(sorted(m for m in sys.modules "
         "if m == 'memrt' or m.startswith(('memrt.', '_memrt')))))")


@pytest.mark.parametrize("value", [None, "0", "off", ""])
def test_memrt_off_imports_nothing(value):
    env = _clean_env() if value is None else _clean_env(MEMRT=value)
    assert _memrt_modules(_LIST, env) == []


def test_memrt_on_registers_only_the_post_import_hook():
    code = ("import sys, json; print(json.dumps([sorted(m for m in sys.modules if m.startswith('memrt')), "
            "[type(f).__name__ for f in sys.meta_path], 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(MEMRT="1"), capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    modules, finders, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "memrt.activation.hooks" in modules and "PostImportFinder" in finders
    assert not torch_loaded, "the start-up hook must not import torch"
    assert not any(m.startswith(("memrt.memory", "memrt.comm", "memrt.profiling")) for m in modules)


@pytest.mark.slow
def test_import_torch_with_memrt_unset_imports_no_memrt_module():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], env=_clean_env(),
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "torch" in imported
    ours = [m for m in imported if m == "memrt" or m.startswith(("memrt.", "_memrt"))]
    assert ours == [], f"memrt modules imported with MEMRT unset: {ours}"


@pytest.mark.alone
def test_pth_costs_under_2ms_when_off(monkeypatch):
    pth = _pth_path()
    monkeypatch.delenv("MEMRT", raising=False)
    before = set(sys.modules)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        site.addpackage(str(pth.parent), pth.name, set())  # what site.py does at start-up: read + exec
        times.append(time.perf_counter() - t0)
    assert set(sys.modules) == before
    assert statistics.median(times) < 2e-3, f"median {statistics.median(times) * 1e3:.3f} ms"


def test_pth_line_reports_a_missing_memrt_and_carries_on(tmp_path):
    # A stale .pth (memrt removed without it): one line on stderr, the interpreter runs normally.
    code = (f"import os, sys; os.environ['MEMRT'] = '1'; sys.modules['memrt'] = None; "
            f"exec({install.pth_text()!r}); print('ran')")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                         text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip().endswith("ran")
    assert "memrt cannot be imported" in out.stderr


def test_startup_module_text_is_valid_and_checks_the_switch(tmp_path):
    (tmp_path / "_memrt_startup.py").write_text(install.startup_module_text())
    code = "import sys, _memrt_startup; _memrt_startup.start(); print('memrt.activation.autoload' in sys.modules)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=_clean_env(PYTHONPATH=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("argv,orig,active,expected", [
    (["/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"], None, None, "torchrun agent"),
    (["-m", "--nproc-per-node"], ["python", "-m", "torch.distributed.run", "t.py"], None, "torchrun agent"),
    (["-c", "--multiprocessing-fork"], ["python", "-c", "from multiprocessing.spawn import spawn_main; "
                                        "spawn_main()", "--multiprocessing-fork"], None, "multiprocessing child"),
    (["-c"], ["python", "-c", "from multiprocessing.forkserver import main; main()"], None, "multiprocessing child"),
    (["/x/torch/_inductor/compile_worker/__main__.py"], ["python", "-m", "torch._inductor.compile_worker"], None,
     "compile worker"),
    (["train.py"], ["python", "train.py"], "1", "child of activated process 1"),
    (["train.py"], ["python", "train.py"], None, None),
    (["train.py"], ["python", "train.py"], "4242", None),  # its own pid: not a child
])
def test_excluded_processes(argv, orig, active, expected):
    got = autoload.excluded_reason(argv, orig or argv, active_pid=active, pid=4242)
    assert got == expected


def test_post_import_finder_calls_back_after_exec(tmp_path, monkeypatch):
    (tmp_path / "memrt_probe_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def callback(module):
        seen.append(module.VALUE)
        module.VALUE += 1

    finder = hooks.PostImportFinder({"memrt_probe_mod": callback})
    sys.meta_path.insert(0, finder)
    try:
        mod = importlib.import_module("memrt_probe_mod")
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        sys.modules.pop("memrt_probe_mod", None)
    assert seen == [41] and mod.VALUE == 42
    assert not isinstance(mod.__loader__, hooks._LoaderProxy)  # introspection sees the real loader


@pytest.fixture
def fresh_session(monkeypatch):
    monkeypatch.setattr(session, "_OFF", False)
    monkeypatch.setattr(session, "_WARNED", False)
    monkeypatch.setattr(session, "_SESSION", None)
    for var in [v for v in os.environ if v.startswith("MEMRT")]:
        monkeypatch.delenv(var)
    return session


def test_failure_warns_once_and_steps_aside(fresh_session, caplog):
    with caplog.at_level(logging.WARNING, logger="memrt.activation"):
        session.fail("test step", RuntimeError("boom"))
        session.fail("test step again", RuntimeError("boom 2"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "continuing without memrt" in warnings[0].getMessage()
    assert session.is_off()


def test_failure_raises_when_strict(fresh_session, monkeypatch):
    monkeypatch.setenv("MEMRT_STRICT", "1")
    with pytest.raises(session.ActivationError, match="boom"):
        session.fail("test step", RuntimeError("boom"))


@pytest.mark.parametrize("rank", [0, 1])
def test_bad_budget_exits_2_with_the_error_printed_by_the_rank_that_has_it(fresh_session, monkeypatch, capsys,
                                                                           rank):
    monkeypatch.setenv("MEMRT", "1")
    monkeypatch.setenv("MEMRT_BUDGET", "lots")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(session, "_LAUNCH", None)
    with pytest.raises(SystemExit) as exc:
        session.load_config_or_exit()
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "MEMRT_BUDGET='lots'" in lines[0] and lines[0].endswith(f"(rank {rank})"), lines


def test_banner_names_every_setting_and_its_source(tmp_path):
    config = load_config({"MEMRT": "1", "MEMRT_BUDGET": "85%"})
    text = format_banner(config=config, launcher="torchrun", world_size=4, nodes=((0, 1), (2, 3)),
                         nodes_source="MEMRT_TOPOLOGY", backend="gloo", run_id="r1", report_dir=tmp_path)
    assert text.splitlines()[0].startswith("memrt ") and "4 ranks = 2 nodes x 2" in text
    for var, item in config.effective().items():
        line = next(line for line in text.splitlines() if line.split()[1:2] == [var])
        assert line.split()[-1] == item["source"]
    assert "85%" in text
    assert describe_nodes(3, ((0, 1), (2,))) == "3 ranks = 2 nodes (2+1)"
    assert "unknown" in describe_nodes(2, None)


def test_budgets_print_in_a_form_that_parses_back():
    from memrt.config import parse_budget

    for share in (0.85, 1 / 3, 0.07, 1e-5, 1.0):
        text = str(Budget(share=share))
        assert "e" not in text and parse_budget("MEMRT_BUDGET", text).share == pytest.approx(share, abs=1e-8), text
    assert str(Budget(share=1e-5)) == "0.001%" and str(Budget(share=0.85)) == "85%"


def test_memrt_run_environment(tmp_path):
    import argparse

    from memrt.activation.run import SITE_DIR, add_arguments, command_environment
    from memrt.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--budget", "85%", "--strict", "--", "python", "t.py"])
    env = command_environment(args, {"PYTHONPATH": "/user/lib", "PATH": "/bin"})
    assert env["MEMRT"] == "1" and env["MEMRT_BUDGET"] == "85%" and env["MEMRT_STRICT"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/user/lib"]
    with pytest.raises(ConfigError, match="MEMRT_BUDGET"):
        command_environment(parser.parse_args(["--budget", "lots", "--", "x"]), {})


def test_memrt_run_sitecustomize_activates_and_chains(tmp_path):
    """Without site-packages' .pth (python -S): memrt run's sitecustomize alone switches memrt on and still
    runs the user's own sitecustomize."""
    from memrt.activation.run import SITE_DIR

    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n")
    code = textwrap.dedent(f"""
        import sys, json
        sys.path[:0] = [{str(SITE_DIR)!r}, {str(user)!r}, {str(REPO)!r}]
        import sitecustomize
        import builtins
        print(json.dumps([getattr(builtins, 'USER_SITECUSTOMIZE_RAN', False),
                          'memrt.activation.hooks' in sys.modules,
                          any(type(f).__name__ == 'PostImportFinder' for f in sys.meta_path)]))
    """)
    out = subprocess.run([sys.executable, "-S", "-c", code], env=_clean_env(MEMRT="1"), capture_output=True,
                         text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True]


@pytest.mark.slow
def test_wrappers_in_process_world_1(fresh_session, monkeypatch, tmp_path, capsys):
    """init_process_group -> session + banner; DDP -> memory plan; fully_shard -> noted; exit -> report."""
    import atexit

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    import memrt
    from memrt.activation import report
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    monkeypatch.setenv("MEMRT", "1")
    monkeypatch.setenv("MEMRT_COMM", "off")  # comm's process-wide state stays out of this pytest process
    monkeypatch.setenv("MEMRT_REPORT_DIR", str(tmp_path / "report"))
    monkeypatch.setenv("MEMRT_AUTOLOAD_ACTIVE", "")  # begin() sets it; monkeypatch removes it afterwards
    monkeypatch.setattr(report, "_nodes", lambda config, world, backend: (((0,),), "test"))
    assert not hooks.installed()
    hooks.install()
    try:
        assert getattr(dist.init_process_group, "__memrt_wrapped__", False)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        atexit.unregister(report.at_exit)
        sess = session.current()
        assert sess is not None and sess.rank == 0 and os.environ["MEMRT_AUTOLOAD_ACTIVE"] == str(os.getpid())
        cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=32)
        model = GPT(cfg)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x, y = gpt_batch(cfg, 2, seed=step)
            lm_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert memrt.plan_of(model) is not None
        sharded = fsdp.fully_shard(torch.nn.Linear(4, 4))  # the name as looked up now
        assert type(sharded).__name__.startswith("FSDP")
        report.at_exit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        hooks.uninstall()
        memrt.disable(model) if "model" in locals() else None
    assert not getattr(dist.init_process_group, "__memrt_wrapped__", False)
    assert not getattr(torch.nn.parallel.DistributedDataParallel.__init__, "__memrt_wrapped__", False)
    err = capsys.readouterr().err
    assert err.count("memrt 0.1.0 on |") == 1 and "memrt summary" in err
    (data,) = [json.loads(p.read_text()) for p in (tmp_path / "report").glob("rank*.json")]
    act = data["meta"]["activation"]
    assert [m["kind"] for m in act["models"]] == ["ddp", "fsdp2"]
    assert act["models"][0]["comm_hook"] == "off (MEMRT_COMM=off)"
    assert act["plans"] and act["failures"] == []


def test_srun_rendezvous_address():
    from memrt.launcher import first_host, slurm_master

    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node3") == "node3"
    assert first_host("a[1,4]") == "a1"
    assert slurm_master({"SLURM_STEP_NODELIST": "n[2-3]", "SLURM_JOB_ID": "123456"}) == ("n2", 20000 + 123456 % 20000)
    assert slurm_master({"SLURM_JOB_ID": "1"}) is None


def test_master_address_is_supplied_only_where_the_launcher_gave_none(monkeypatch):
    from memrt import launcher
    from memrt.errors import ConfigError
    from memrt.launcher import discover_launch, master_address

    monkeypatch.setattr(launcher, "_mpi_world_is", lambda world: False)  # srun without MPI (none started here)

    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert master_address(discover_launch(torchrun), torchrun) is None
    given = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    assert master_address(discover_launch(given), given) is None
    addr, port = master_address(discover_launch({}), {})
    assert addr == "127.0.0.1" and 0 < port < 65536
    srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "gpu[4-5]", "SLURM_JOB_ID": "77"}
    assert master_address(discover_launch(srun), srun) == ("gpu4", 20000 + 77)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        bare = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}
        master_address(discover_launch(bare), bare)


def _gc_session(freeze: bool = True):
    from types import SimpleNamespace

    return SimpleNamespace(gc_frozen=None, config=SimpleNamespace(gc_freeze=freeze))


def test_gc_freeze_leaves_the_collector_alone_when_off_or_turned_off_by_the_job():
    import gc

    from memrt.activation.collector import freeze_setup

    before = gc.get_freeze_count()
    off = _gc_session(freeze=False)
    freeze_setup(off)
    assert off.gc_frozen == {"objects": 0, "seconds": 0.0, "skipped": "MEMRT_GC_FREEZE=off"}
    sess = _gc_session()
    gc.disable()
    try:
        freeze_setup(sess)
    finally:
        gc.enable()
    assert sess.gc_frozen["objects"] == 0 and "turned the collector off" in sess.gc_frozen["skipped"]
    assert gc.get_freeze_count() == before


def test_gc_freeze_failure_is_reported_and_leaves_the_collector_as_it_was(monkeypatch, caplog):
    import gc

    from memrt.activation.collector import freeze_setup

    def broken() -> None:
        raise RuntimeError("no freezing here")

    # objects an earlier test of this process froze may die during this one (the count would drop): none here
    gc.unfreeze()
    monkeypatch.setattr(gc, "freeze", broken)
    before = gc.get_freeze_count()
    sess = _gc_session()
    with caplog.at_level(logging.WARNING, logger="memrt.activation"):
        freeze_setup(sess)
    assert sess.gc_frozen["skipped"] == "RuntimeError: no freezing here" and sess.gc_frozen["objects"] == 0
    assert "left as it was" in caplog.text and gc.get_freeze_count() == before and gc.isenabled()


def test_gc_freeze_leaves_full_collections_only_the_newer_objects():
    """In a fresh process with torch imported: frozen once, the objects a full collection scans drop from
    torch's ~10^5 to the few made since; a second call freezes nothing more."""
    code = textwrap.dedent("""
        import gc, json, sys, torch
        from types import SimpleNamespace
        from memrt.activation.collector import freeze_setup
        sess = SimpleNamespace(gc_frozen=None, config=SimpleNamespace(gc_freeze=True))
        scanned = len(gc.get_objects())
        freeze_setup(sess)
        first = dict(sess.gc_frozen)
        freeze_setup(sess)
        print(json.dumps({"before": scanned, "after": len(gc.get_objects()), "frozen": first,
                          "again": sess.gc_frozen, "count": gc.get_freeze_count()}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["before"] > 50_000 and s["frozen"]["objects"] > 50_000, s
    assert s["after"] < s["before"] / 100, s
    assert s["again"] == s["frozen"] and s["count"] == s["frozen"]["objects"], s
