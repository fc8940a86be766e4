"""The ``memrt`` command (also ``python -m memrt``).

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and ``run(args) -> int``
and keeps its top level free of heavy imports (torch is imported inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from memrt._version import __version__
from memrt.errors import MemrtError

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help)
COMMANDS = {
    "info": ("memrt.info", "show versions, devices, launcher and every setting with its source"),
    "run": ("memrt.activation.run", "run a command with memrt switched on (no .pth needed)"),
    "demo": ("memrt.demo", "short GPT-style training, stock vs memrt, side by side"),
    "report": ("memrt.profiling.report", "merge per-rank files of a run into text, JSON and plots"),
    "bench": ("memrt.comm.bench", "probe links and benchmark collectives (memrt bench comm)"),
}


def _parser(only: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memrt", description="memrt: memory and communication runtime for PyTorch")
    parser.add_argument("--version", action="version", version=f"memrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as exc:  # a subcommand whose module is not there yet
                if exc.name != module:
                    raise
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = _parser(only)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "allow_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except MemrtError as exc:
        print(f"memrt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
