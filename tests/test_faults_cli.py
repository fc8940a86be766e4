"""Fault injection for the ``memrt`` command line and the settings a run and ``memrt info`` accept.

``memrt run`` options it does not know are rejected with one line (known options, a did-you-mean) and the
user's command never starts; before, ``memrt run --bogus -- cmd`` appended --bogus to the command and
``memrt run --bugdet 2GiB -- true`` said "command not found: 2GiB". A run and ``memrt info`` accept and
reject the same values (before, MEMRT_BUDGET=0.00001% passed info and was dropped in a run; ``²,0`` as a
topology raised ValueError from str.isdigit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _faults import record_time

pytestmark = pytest.mark.slow


def _memrt(*args: str, cwd: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    run_env.update(env)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memrt", *args], cwd=cwd, env=run_env, capture_output=True,
                          text=True, timeout=120)
    return proc, time.perf_counter() - t0


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


KNOWN = "known options: --budget, --offload, --comm, --compress, --topology, --report-dir, --log-level, --strict"


@pytest.mark.parametrize("args,needles", [
    (["--bogus", "--"], ["unknown option --bogus;", KNOWN, "the command to run goes after --"]),
    (["--bugdet", "2GiB", "--"], ["unknown option --bugdet (did you mean --budget?)", KNOWN]),
    (["--bud", "2GiB", "--"], ["unknown option --bud (did you mean --budget?)"]),  # no silent abbreviations
    (["--budget=2GiB", "--strcit", "--"], ["unknown option --strcit (did you mean --strict?)"]),
    (["--budget", "0.00001%", "--"], ["MEMRT_BUDGET='0.00001%' is not valid: expected a share from 0.001% to 100%"]),
    (["--topology", "²,0", "--"], ["MEMRT_TOPOLOGY='²,0' is not valid", "'²' is not a rank"]),
    (["--comm", "ring", "--"], ["MEMRT_COMM='ring' is not valid: expected one of auto|flat|hier|off"]),
])
def test_memrt_run_misuse_stops_before_the_command_with_one_line(tmp_path, args, needles):
    marker = tmp_path / "ran"
    proc, seconds = _memrt("run", *args, sys.executable, "-c", f"open({str(marker)!r}, 'w')", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    for needle in needles:
        assert needle in line, line
    assert not marker.exists(), "the user's command must not start"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    record_time(f"memrt-run-{args[0].lstrip('-').split('=')[0]}", seconds)


def test_memrt_run_passes_the_command_its_own_options_untouched(tmp_path):
    proc, _ = _memrt("run", "--budget", "2GiB", "--", sys.executable, "-c",
                     "import os, sys; print(os.environ['MEMRT'], os.environ['MEMRT_BUDGET'], sys.argv[1:])",
                     "--bogus", "x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 2GiB ['--bogus', 'x']"


@pytest.mark.parametrize("args,needle", [
    (["info", "--jsn"], "memrt info: unknown option --jsn (did you mean --json?); known options: --json"),
    (["info", "extra"], "memrt info: unexpected argument 'extra'"),
    (["repot", "x"], "memrt: unknown command 'repot' (did you mean report?)"),
    (["report", "--no-plot", "x"], "memrt report: unknown option --no-plot (did you mean --no-plots?)"),
])
def test_other_commands_reject_unknown_arguments_with_one_line(tmp_path, args, needle):
    proc, _ = _memrt(*args, cwd=tmp_path)
    assert proc.returncode == 2 and needle in _one_line(proc)


BAD_FOR_BOTH = [
    ("MEMRT_BUDGET", "0.00001%"), ("MEMRT_BUDGET", "0%"), ("MEMRT_BUDGET", "100000TB"),
    ("MEMRT_BUDGET", "١GiB"), ("MEMRT_TOPOLOGY", "²,0"), ("MEMRT_TOPOLOGY", "0,١"),
]
GOOD_FOR_BOTH = [("MEMRT_BUDGET", "0.001%"), ("MEMRT_BUDGET", "85%"), ("MEMRT_BUDGET", "1GiB"),
                 ("MEMRT_TOPOLOGY", "0,1;2,3")]


@pytest.mark.parametrize("var,value", BAD_FOR_BOTH + GOOD_FOR_BOTH)
def test_memrt_info_and_a_run_accept_and_reject_the_same_values(monkeypatch, var, value):
    """In process: memrt info's collect_info and the run's start-up check (session.load_config_or_exit)."""
    from memrt.activation import session
    from memrt.errors import ConfigError
    from memrt.info import collect_info

    for k in list(os.environ):
        if k.startswith("MEMRT"):
            monkeypatch.delenv(k)
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(session, "_LAUNCH", None)
    try:
        collect_info()
        info_ok = True
    except ConfigError as exc:
        info_ok = False
        assert var in str(exc) and "\n" not in str(exc)
    try:
        session.load_config_or_exit()
        run_ok = True
    except SystemExit as exc:
        assert exc.code == 2
        run_ok = False
    assert info_ok == run_ok == ((var, value) in GOOD_FOR_BOTH)


def test_report_dir_that_cannot_be_written_is_refused_by_info_and_a_run(tmp_path, monkeypatch, capsys):
    from memrt.activation import session
    from memrt.activation.checks import folder_problem
    from memrt.errors import ConfigError
    from memrt.info import collect_info

    blocker = tmp_path / "file"
    blocker.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "at-all")
    assert "is not a directory" in folder_problem(blocker / "rep")
    assert "broken symbolic link" in folder_problem(dangling / "rep")
    assert "cannot create files in /proc" in folder_problem("/proc/memrt-report")
    assert folder_problem(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()
    before = sorted(p.name for p in tmp_path.iterdir())
    for k in list(os.environ):
        if k.startswith("MEMRT"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("MEMRT_REPORT_DIR", str(blocker / "rep"))
    monkeypatch.setattr(session, "_LAUNCH", None)
    with pytest.raises(ConfigError, match="MEMRT_REPORT_DIR"):
        collect_info()
    with pytest.raises(SystemExit):
        session.load_config_or_exit()
    assert "MEMRT_REPORT_DIR=" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "the check leaves nothing behind"
