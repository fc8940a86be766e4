"""``memrt plan [--budgets 60%,1GiB,...] -- <command>``: a job's memory frontier from its first steps, then stop.

Pick a budget in one command: the job runs under ``MEMRT=1`` (as with ``memrt run``) until memrt has profiled
its first training step; then each rank writes the frontier of its model (:mod:`memrt.memory.frontier`: for a
range of budgets the predicted step peak, the time the plan adds and the units kept / recomputed / offloaded,
and the smallest feasible budget) to a folder, and the job stops at its next training step (``SystemExit(0)``
raised in that step's forward: the job's ``finally`` blocks and memrt's exit handlers run). This command then
prints rank 0's frontier (``--json FILE`` keeps every rank's). With several models (a GAN's) the frontier is the
first one's memrt profiles. A job that ends before its second training step has no frontier: the command says
so and exits 1.

The job side: :func:`watch` (wired by ``memrt.activation.wiring`` for every model memrt plans when
``MEMRT_PLAN_OUT`` is set, which this command sets; not a user setting).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "watch", "REQUEST"]

REQUEST = "request.json"
"""The file in MEMRT_PLAN_OUT where this command leaves the budgets asked for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budgets", help="budgets to plan for, comma-separated: sizes (1GiB) or shares of each rank's "
                                          "device (60%%); default: spread from the smallest feasible to keep-all")
    parser.add_argument("--offload", help="MEMRT_OFFLOAD for the plans: auto|none|host|disk")
    parser.add_argument("--json", dest="json_out", help="write every rank's frontier to this file")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")


def _budgets(raw: str | None) -> list[str] | None:
    if raw is None:
        return None
    from memrt.config import parse_budget

    out = [b.strip() for b in raw.split(",") if b.strip()]
    if not out:
        raise ValueError("--budgets is empty: give sizes or shares such as 60%,1GiB")
    for b in out:
        parse_budget("--budgets", b)  # a bad one names the option
    return out


def run(args: argparse.Namespace) -> int:
    from memrt.activation.run import command_environment
    from memrt.errors import ConfigError

    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("memrt plan: no command given: memrt plan [--budgets 60%,1GiB] -- python train.py ...", file=sys.stderr)
        return 2
    try:
        budgets = _budgets(args.budgets)
    except (ValueError, ConfigError) as exc:
        print(f"memrt plan: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="memrt-plan-") as out:
        (Path(out) / REQUEST).write_text(json.dumps({"budgets": budgets}))
        # any budget makes memrt profile the first step; the plans themselves are made at the asked budgets
        run_args = argparse.Namespace(budget="100%", offload=args.offload)
        try:
            env = command_environment(run_args)
        except ConfigError as exc:
            print(f"memrt plan: {exc}", file=sys.stderr)
            return 2
        env["MEMRT_PLAN_OUT"] = out
        try:
            rc = subprocess.call(cmd, env=env)
        except FileNotFoundError:
            print(f"memrt plan: command not found: {cmd[0]}", file=sys.stderr)
            return 127
        ranks = sorted(Path(out).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if not ranks:
            print(f"memrt plan: the command ended (exit {rc}) before memrt profiled a training step of a model it "
                  "plans: no frontier (the job needs two training steps of a DDP, FSDP2 or optimizer-owned model)",
                  file=sys.stderr)
            return 1
        found = [json.loads(p.read_text()) for p in ranks]
    _print(found[0])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(found, indent=2))
    return 0


def _print(rank: dict[str, Any]) -> None:
    from memrt.memory.frontier import Frontier, FrontierRow

    for model in rank["models"]:
        f = model["frontier"]
        front = Frontier(**{**f, "rows": [FrontierRow(**r) for r in f["rows"]]})
        print(f"memrt plan | rank {rank['rank']} | {model['module']} on {model['device']} "
              f"({front.units} unit calls)")
        print(front.table())


# ---- the job's side ----------------------------------------------------------------------------------------
def watch(sess: Any, module: Any, device: str) -> bool:
    """Under ``MEMRT_PLAN_OUT``: when memrt has profiled ``module``'s first training step, write its frontier
    to ``rank<N>.json`` there and stop the job (see the module docstring). False when nothing to watch."""
    from memrt.memory.auto import on_profiled

    out = sess.config.plan_out
    if not out:
        return False

    def profiled(profile: Any) -> None:
        import torch

        from memrt.memory.frontier import frontier
        from memrt.memory.meter import device_capacity_bytes

        request = json.loads((Path(out) / REQUEST).read_text()) if (Path(out) / REQUEST).exists() else {}
        capacity = device_capacity_bytes(torch.device(device))
        budgets = None
        if request.get("budgets"):
            from memrt.config import parse_budget

            budgets = [parse_budget("--budgets", b).resolve(capacity) for b in request["budgets"]]
        front = frontier(profile, budgets, offload=sess.config.offload, config=sess.config)
        path = Path(out) / f"rank{sess.rank}.json"
        found = json.loads(path.read_text()) if path.exists() else {"rank": sess.rank, "models": []}
        found["models"].append({"module": type(module).__name__, "device": device, "capacity_bytes": capacity,
                                "frontier": front.to_dict()})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(found))
        os.replace(tmp, path)
        raise SystemExit(0)  # the job stops here: its frontier is written

    return on_profiled(module, profiled)
