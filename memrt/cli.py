"""The ``memrt`` command (also ``python -m memrt``).

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and ``run(args) -> int``
and keeps its top level free of heavy imports (torch is imported inside ``run``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from memrt._version import __version__
from memrt.errors import MemrtError

__all__ = ["main", "COMMANDS", "known_options", "unknown_arguments_message"]

# name -> (module, one-line help)
COMMANDS = {
    "info": ("memrt.info", "show versions, devices, launcher and every setting with its source"),
    "run": ("memrt.activation.run", "run a command with memrt switched on (no .pth needed)"),
    "plan": ("memrt.activation.plan", "pick a budget: a job's memory frontier from its first steps, then stop"),
    "demo": ("memrt.demo", "short GPT-style training, stock vs memrt, side by side"),
    "report": ("memrt.profiling.report", "merge per-rank files of a run into text, JSON and plots"),
    "bench": ("memrt.bench", "probe links and benchmark collectives (memrt bench comm)"),
    "project": ("memrt.comm.project", "predict a job's step time on bigger clusters from a run's report"),
}


def _parser(only: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="memrt", description="memrt: memory and communication runtime for PyTorch")
    parser.add_argument("--version", action="version", version=f"memrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subs = {}
    for name, (module, help_text) in COMMANDS.items():
        # No abbreviations: `--bud` must not silently mean --budget (or --comm a prefix of --compress).
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        subs[name] = p
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser, subs


def known_options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options of ``parser`` (``--budget``, ...), in the order its help lists them."""
    out = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its options
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and longs[0] != "--help":
            out.append(longs[0])
    return out


def unknown_arguments_message(command: str, parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """One line for arguments ``memrt COMMAND`` does not take: the first unknown option with a did-you-mean
    and the known options, or the unexpected argument."""
    known = known_options(parser)
    option = next((e.split("=", 1)[0] for e in extra if e.startswith("-") and e != "-"), None)
    if option is None:
        return f"memrt {command}: unexpected argument {extra[0]!r}" + (
            "; give the command after --, e.g. memrt run -- python train.py" if command == "run" else "")
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    listed = ", ".join(known) or "none"
    tail = "; the command to run goes after --" if command == "run" else ""
    return f"memrt {command}: unknown option {option}{hint}; known options: {listed}{tail}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"memrt: unknown command {argv[0]!r}{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser, subs = _parser(only)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            print(unknown_arguments_message("", parser, extra).replace("memrt :", "memrt:"), file=sys.stderr)
            return 2
        parser.print_help()
        return 2
    if extra:
        print(unknown_arguments_message(args.command, subs[args.command], extra), file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except MemrtError as exc:
        print(f"memrt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
