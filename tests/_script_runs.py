"""Scripts a test file runs as separate processes, all started at once (launches are the expensive part)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest


class ScriptRuns:
    """Each job ``name -> (argv, settings)`` runs ``python *argv --out params.pt`` in its own folder under
    ``root`` with ``env(**settings)``, its output in ``output.txt`` (a file, not a pipe: no run waits on a full
    pipe). :meth:`get` waits for one and checks its exit code (``returncodes``, default 0): (output, folder)."""

    def __init__(self, root: Path, jobs: Mapping[str, tuple[Sequence[str], Mapping[str, str]]],
                 env: Callable[..., dict[str, str]], *, timeout: float = 300,
                 returncodes: Mapping[str, int] | None = None) -> None:
        self.timeout = timeout
        self.returncodes = dict(returncodes or {})
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.done: dict[str, tuple[str, Path]] = {}
        for name, (argv, settings) in jobs.items():
            folder = root / name.replace(" ", "-")
            folder.mkdir(parents=True)
            with open(folder / "output.txt", "w") as out:
                proc = subprocess.Popen([sys.executable, *argv, "--out", "params.pt"], env=env(**settings),
                                        cwd=folder, stdout=out, stderr=subprocess.STDOUT)
            self.procs[name] = (proc, folder)

    def get(self, name: str) -> tuple[str, Path]:
        if name not in self.done:
            proc, folder = self.procs[name]
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"{name} hung for {self.timeout}s:\n{(folder / 'output.txt').read_text()[-3000:]}")
            text = (folder / "output.txt").read_text()
            expected = self.returncodes.get(name, 0)
            assert proc.returncode == expected, f"{name}: exit {proc.returncode}\n{text[-4000:]}"
            self.done[name] = (text, folder)
        return self.done[name]

    def close(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
