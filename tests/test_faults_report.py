"""Fault injection for ``memrt report``: malformed rank files, a reused report folder, per-rank budgets and
devices, private files. Malformed files are named in one line each and left out, never a traceback; one
report is one run; each rank's peak is compared with its own budget.

Before these checks: ``"schema": "v2"`` raised TypeError, ``"rank": "zero"`` ValueError, a comm record
without ``nbytes`` KeyError; a reused folder merged files of two runs; rank 1 showed 120.3% budget use
(rank 0's budget applied to it); folders and files were created 0755 / 0644.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _faults import EXAMPLE, record_time, torchrun
from memrt.cli import main
from memrt.profiling.recorder import CommRecord, Recorder

pytestmark = pytest.mark.slow

MIB = 2**20


def _rank_file(d: Path, rank: int, *, run_id: str = "run-A", world: int = 2, budget: int | None = 100 * MIB,
               peak: int = 50 * MIB, device: str = "cpu") -> Path:
    rec = Recorder()
    rec.record_memory(MIB, "step_begin", "step")
    rec.record_memory(peak, "unit_begin", "blocks.0@forward")
    rec.record_memory(2 * MIB, "unit_end", "blocks.0@backward")
    rec.record_comm(CommRecord(op="all_reduce", dtype="float32", nbytes=4 * MIB, group_size=world, algorithm="flat",
                               seconds=1e-3, start=rec.t0 + 0.01, tier_bytes={"intra": 4 * MIB}))
    rec.record_trace("memrt::step", rec.t0, rec.t0 + 0.02)
    rec.add_plan({"units": [{"name": "blocks.0", "action": "keep", "bytes_kept": MIB, "bytes_freed": 0,
                             "bytes_moved": 0, "added_seconds": 0.0}],
                  "budget_bytes": budget, "predicted_peak_bytes": peak, "measured_peak_bytes": peak, "device": device})
    rec.set_meta(run_id=run_id, rank=rank, world_size=world, fixed_bytes=MIB,
                 activation={"run_id": run_id, "budget_bytes": budget, "plans": [],
                             "device": {"kind": device.split(":")[0], "name": device, "capacity_bytes": 2**34}})
    return rec.write(d, rank)


def _report(d: Path, capsys, *extra: str) -> tuple[int, str, list[str]]:
    rc = main(["report", str(d), "--no-plots", *extra])
    cap = capsys.readouterr()
    return rc, cap.out, [line for line in cap.err.splitlines() if line.strip()]


def _corrupt(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


MALFORMED = [
    pytest.param(lambda d: d.update(schema="v2"), "schema 'v2' is not one memrt writes", id="schema-v2"),
    pytest.param(lambda d: d.update(schema=99), "schema 99 is newer than this memrt reads", id="schema-newer"),
    pytest.param(lambda d: d.update(rank="zero"), "'rank' is 'zero', not a rank number", id="rank-zero"),
    pytest.param(lambda d: d["memory"].__setitem__(1, {"t": 0.1, "kind": "sample"}), "memory entry 1 has no "
                 "'live_bytes'", id="memory-entry-missing-bytes"),
    pytest.param(lambda d: d["memory"].__setitem__(0, [1, 2]), "memory entry 0 is list, not an object",
                 id="memory-entry-list"),
    pytest.param(lambda d: d["memory"][2].update(live_bytes="lots"), "memory entry 2 has a bad 'live_bytes'",
                 id="memory-bytes-text"),
    pytest.param(lambda d: d["comm"][0].pop("nbytes"), "comm entry 0 has no 'nbytes'", id="comm-without-bytes"),
    pytest.param(lambda d: d["comm"][0].update(seconds=None), "comm entry 0 has a bad 'seconds'", id="comm-seconds"),
    pytest.param(lambda d: d["comm"][0].update(tier_bytes={"intra": "x"}), "comm entry 0 has a bad 'tier_bytes'",
                 id="comm-tier-bytes"),
    pytest.param(lambda d: d["trace"][0].pop("dur_us"), "trace entry 0 has no 'dur_us'", id="trace-without-dur"),
    pytest.param(lambda d: d["plans"][0].update(budget_bytes="100MB"), "plan 0 has a bad 'budget_bytes'",
                 id="plan-budget-text"),
    pytest.param(lambda d: d["plans"][0]["units"][0].update(bytes_kept=[1]), "plan 0 unit entry 0 has a bad "
                 "'bytes_kept'", id="plan-unit-bytes"),
    pytest.param(lambda d: d.update(meta=[1]), "'meta' is list, not an object", id="meta-list"),
    pytest.param(lambda d: d.update(memory={"t": 1}), "'memory' is dict, not a list", id="memory-not-list"),
]


@pytest.mark.parametrize("change,reason", MALFORMED)
def test_a_malformed_rank_file_is_named_in_one_line_and_left_out(tmp_path, capsys, change, reason):
    _rank_file(tmp_path, 0)
    _corrupt(_rank_file(tmp_path, 1), change)
    rc, out, err = _report(tmp_path, capsys)
    assert rc == 1
    assert len(err) == 1 and "rank1.json" in err[0] and reason in err[0] and "left out" in err[0], err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ranks"] == [0] and "== memory" in out


def test_a_folder_of_only_malformed_files_is_one_clear_error(tmp_path, capsys):
    _corrupt(_rank_file(tmp_path, 0), lambda d: d.update(rank="zero"))
    (tmp_path / "rank1.json").write_text("[1, 2]")
    rc, _, err = _report(tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("memrt: error: nothing to report")
    assert "rank0.json: 'rank' is 'zero'" in err[0] and "rank1.json: not a memrt rank file" in err[0]
    assert not (tmp_path / "report.json").exists()


def _paths(data, prefix=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data[:3]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def sound_file(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("sound")
    return json.loads(_rank_file(d, 1).read_text())


JUNK = [None, True, -1, 2**70, float("nan"), float("inf"), 0.5, "x", "", [], [1, "a"], {}, {"a": 1}]
_REMOVED = object()


def test_any_one_field_replaced_by_junk_never_gives_a_traceback(tmp_path, capsys, sound_file):
    """Every field of a sound rank file (lists: their first entries), in turn replaced by each junk value or
    removed: memrt report ends with status 0 or 1, and with one line for the file when it is left out (a rank
    number that differs from the file name is one warning line, status 0)."""
    d = tmp_path / "case"
    d.mkdir()
    _rank_file(d, 0)
    cases = 0
    for path in _paths(sound_file):
        for junk in [*JUNK, _REMOVED]:
            broken = copy.deepcopy(sound_file)
            holder = broken
            for key in path[:-1]:
                holder = holder[key]
            if junk is _REMOVED:
                del holder[path[-1]]
            else:
                holder[path[-1]] = junk
            (d / "rank1.json").write_text(json.dumps(broken))
            rc = main(["report", str(d), "--no-plots", "--no-traces"])
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert rc in (0, 1) and len(err) <= 1 and (rc == 0 or len(err) == 1), (path, junk, err)
            cases += 1
    assert cases > 500


def test_a_reused_report_folder_reports_one_run_and_names_the_others(tmp_path, capsys):
    _rank_file(tmp_path, 0, run_id="run-A")
    _rank_file(tmp_path, 1, run_id="run-A")
    time.sleep(0.05)
    _rank_file(tmp_path, 0, run_id="run-B", world=1)  # a later, smaller run in the same MEMRT_REPORT_DIR
    rc, out, err = _report(tmp_path, capsys)
    assert rc == 1 and "| run run-B" in out.splitlines()[0]
    assert err == [f"memrt report: {tmp_path / 'rank1.json'}: of run run-A, not of the reported run run-B "
                   "(a reused report folder?); skipped"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ranks"] == [0] and report["run_id"] == "run-B"
    # the older run on request: its rank 0 file was overwritten, which the report says
    rc, out, err = _report(tmp_path, capsys, "--run", "run-A")
    assert rc == 1 and json.loads((tmp_path / "report.json").read_text())["ranks"] == [1]
    assert any("rank0.json: of run run-B" in e for e in err)
    assert main(["report", str(tmp_path), "--run", "run-C"]) == 2
    assert "no rank file of run 'run-C'" in capsys.readouterr().err


def test_each_rank_is_measured_against_its_own_budget_and_device(tmp_path, capsys):
    _rank_file(tmp_path, 0, budget=10 * MIB, peak=9 * MIB, device="cuda:0")
    _rank_file(tmp_path, 1, budget=200 * MIB, peak=14 * MIB, device="cpu")
    rc, out, _ = _report(tmp_path, capsys)
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1] in ("0", "1") and "step" in line}
    assert "10.00 MiB" in rows["0"] and "90.0%" in rows["0"] and "cuda:0" in rows["0"]
    assert "200.00 MiB" in rows["1"] and "7.0%" in rows["1"] and " cpu " in rows["1"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["budgets"] == {"0": 10 * MIB, "1": 200 * MIB} and report["budget_bytes"] is None
    assert report["devices"] == {"0": "cuda:0", "1": "cpu"}


def test_report_folders_and_files_are_private(tmp_path, capsys):
    _rank_file(tmp_path / "a" / "b", 0, world=1)
    for folder in (tmp_path / "a", tmp_path / "a" / "b"):
        assert oct(folder.stat().st_mode & 0o777) == "0o700", folder
    assert oct((tmp_path / "a" / "b" / "rank0.json").stat().st_mode & 0o777) == "0o600"
    out = tmp_path / "out" / "deeper"
    assert main(["report", str(tmp_path / "a" / "b"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == "0o700"
    files = list(out.iterdir())
    assert {"report.txt", "report.json", "trace.json"} <= {f.name for f in files}
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files), [(f.name, oct(f.stat().st_mode)) for f in files]


def test_a_real_run_with_per_rank_budgets_then_a_smaller_run_in_the_same_folder(tmp_path):
    """MEMRT=1 with a different MEMRT_BUDGET per rank, report; then a one-rank run reuses the folder."""
    rep = tmp_path / "rep"
    run = torchrun(tmp_path, EXAMPLE, "--steps", "3", r0="MEMRT_BUDGET=64MiB", r1="MEMRT_BUDGET=50%", MEMRT="1",
                   MEMRT_REPORT_DIR=str(rep))
    assert run.rc == 0 and "2/2 ranks reported" in run.out, run.out[-4000:]
    metas = [json.loads((rep / f"rank{r}.json").read_text())["meta"]["activation"] for r in (0, 1)]
    assert metas[0]["budget_bytes"] == 64 * MIB and metas[1]["budget_bytes"] == metas[1]["device"]["capacity_bytes"] // 2
    assert metas[0]["device"]["kind"] == "cpu"
    proc = subprocess.run([sys.executable, "-m", "memrt", "report", str(rep), "--no-plots"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if "step " in line and line.strip()[:1].isdigit()}
    assert "64.00 MiB" in rows["0"] and "%" in rows["0"]
    half = metas[1]["budget_bytes"] / 2**30
    assert f"{half:.2f} GiB" in rows["1"] and "0.0%" in rows["1"], rows  # ~3 MiB of ~12 GiB, not rank 0's budget
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")}
    env.update(MEMRT="1", MEMRT_REPORT_DIR=str(rep), OMP_NUM_THREADS="1")
    from memrt.testing import venv_bin

    single = subprocess.run([venv_bin("torchrun"), "--standalone", "--nproc-per-node", "1", str(EXAMPLE),
                             "--steps", "1"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "memrt", "report", str(rep), "--no-plots"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [l for l in proc.stderr.splitlines() if l.strip()]
    assert "rank1.json: of run" in line and "not of the reported run" in line and line.endswith("skipped")
    assert json.loads((rep / "report.json").read_text())["ranks"] == [0]
    record_time("report-of-reused-folder", time.perf_counter() - t0)
