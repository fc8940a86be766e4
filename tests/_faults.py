"""Shared pieces of the fault-injection tests: 2-rank torchrun launches with a different environment per rank.

The per-rank wrapper is the one a user would write (``R0ENV`` / ``R1ENV`` hold ``VAR=value`` words that
rank 0 / rank 1 export before Python starts). Each launch measures its wall time; every test prints
``fault-time <case> <seconds>`` so that ``pytest -s tests/test_faults_*.py | grep ^fault-time`` lists the
times to a clear exit (docs/sections/activation.md, Reliability).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from memrt.testing import venv_bin

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "activation_unchanged_ddp.py"
COMM_JOB = REPO / "tests" / "scripts" / "comm_api_job.py"
WRAPPER = '#!/bin/bash\nv=R${{LOCAL_RANK}}ENV; [ -n "${{!v}}" ] && export ${{!v}}\nexec {python} "$@"\n'


@dataclass
class Launch:
    rc: int
    """torchrun's exit status."""
    out: str
    """stdout + stderr of torchrun and both ranks."""
    seconds: float
    """Wall time from starting torchrun to its exit."""

    def errors(self) -> list[str]:
        """memrt's error lines (``memrt: error: ...``), one per rank that printed one."""
        return [line for line in self.out.splitlines() if line.startswith("memrt: error:")]

    def worker_exit_codes(self) -> list[int]:
        """Exit codes torchrun reports for its failed workers (``exitcode  : 2``)."""
        return [int(x) for x in re.findall(r"exitcode\s*:\s*(-?\d+)", self.out)]

    def tracebacks(self) -> int:
        """Python tracebacks printed by the ranks (torchrun's own ChildFailedError traceback excluded)."""
        lines = self.out.splitlines()
        return sum(1 for i, line in enumerate(lines) if "Traceback (most recent call last)" in line
                   and not (i + 1 < len(lines) and "bin/torchrun" in lines[i + 1]))


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The test process's environment without memrt or launcher variables, a private TMPDIR, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEMRT", "R0ENV", "R1ENV")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                           "MASTER_ADDR", "MASTER_PORT")}
    private_tmp = tmp / "tmp"
    private_tmp.mkdir(exist_ok=True)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(private_tmp), HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def wrapper(tmp: Path) -> Path:
    path = tmp / "wrap.sh"
    path.write_text(WRAPPER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def torchrun(tmp: Path, script: Path, *args: str, r0: str = "", r1: str = "", timeout: float = 150,
             **env: str) -> Launch:
    """``torchrun --standalone --nproc-per-node 2 --no-python ./wrap.sh script args`` in ``tmp``."""
    run_env = clean_env(tmp, R0ENV=r0, R1ENV=r1, **env)
    argv = [venv_bin("torchrun"), "--standalone", "--nproc-per-node", "2", "--no-python", str(wrapper(tmp)),
            str(script), *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=run_env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"hung: no exit within {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    return Launch(rc=proc.returncode, out=proc.stdout + proc.stderr, seconds=time.perf_counter() - t0)


def record_time(case: str, seconds: float) -> None:
    print(f"\nfault-time {case} {seconds:.3f}s" if seconds < 1 else f"\nfault-time {case} {seconds:.1f}s", flush=True)


def leftovers(tmp: Path, *, allowed: tuple[str, ...] = ("wrap.sh", "tmp")) -> list[str]:
    """Files and folders a failed launch left in its folder or its private TMPDIR."""
    left = [p.name for p in tmp.iterdir() if p.name not in allowed]
    if (tmp / "tmp").is_dir():  # torch's own folders (torchrun logs, inductor cache) are not memrt's
        left += [f"tmp/{p.name}" for p in (tmp / "tmp").iterdir() if not p.name.startswith(("torchelastic_", "torchinductor_"))]
    return sorted(left)
