"""``memrt run [options] -- <command> [args...]``: the command with memrt switched on, no .pth needed.

For read-only site-packages, or to try memrt without installing its start-up hook: like ``ddtrace-run``
it sets ``MEMRT=1`` (plus any option given here), puts memrt's own ``sitecustomize`` first on
``PYTHONPATH`` (it activates memrt, then runs the sitecustomize it shadows, if any) and replaces itself
with the command. Launchers work unchanged: ``memrt run -- torchrun --nproc-per-node 2 train.py``,
``memrt run -- mpiexec -n 2 python train.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from memrt.config import environ, load_config

__all__ = ["add_arguments", "run", "command_environment", "SITE_DIR"]

SITE_DIR = Path(__file__).parent / "_site"
"""The folder holding memrt's sitecustomize.py."""

_OPTIONS = (("budget", "MEMRT_BUDGET"), ("offload", "MEMRT_OFFLOAD"), ("comm", "MEMRT_COMM"),
            ("compress", "MEMRT_COMPRESS"), ("topology", "MEMRT_TOPOLOGY"), ("report_dir", "MEMRT_REPORT_DIR"),
            ("log_level", "MEMRT_LOG_LEVEL"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", help="MEMRT_BUDGET: bytes, a size (3GiB) or a share of each rank's device (85%%)")
    parser.add_argument("--offload", help="MEMRT_OFFLOAD: auto|none|host|disk")
    parser.add_argument("--comm", help="MEMRT_COMM: auto|flat|hier|off")
    parser.add_argument("--compress", help="MEMRT_COMPRESS: none|auto|bf16|fp16|int8 (inter-node hop of DDP gradients only)")
    parser.add_argument("--topology", help="MEMRT_TOPOLOGY: node grouping such as 0,1;2,3")
    parser.add_argument("--report-dir", dest="report_dir", help="MEMRT_REPORT_DIR (default ./memrt-report/<run id>/)")
    parser.add_argument("--log-level", dest="log_level", help="MEMRT_LOG_LEVEL: debug|info|warning|error")
    parser.add_argument("--strict", action="store_true", help="MEMRT_STRICT=1: fail instead of warn-and-continue")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")


def command_environment(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: MEMRT=1, the options as MEMRT_* variables, memrt's sitecustomize first."""
    env = dict(environ() if base is None else base)
    env["MEMRT"] = "1"
    for attr, var in _OPTIONS:
        value = getattr(args, attr, None)
        if value is not None:
            env[var] = str(value)
    if getattr(args, "strict", False):
        env["MEMRT_STRICT"] = "1"
    load_config(env)  # a bad option fails here, with the variable's name, before the command starts
    parts = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd or [])  # options memrt run does not know never reach the command: the CLI rejects them
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("memrt run: give a command after --, e.g. memrt run -- torchrun --nproc-per-node 2 train.py",
              file=sys.stderr)
        return 2
    env = command_environment(args)
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        print(f"memrt run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, cmd, env)
    return 0  # not reached
