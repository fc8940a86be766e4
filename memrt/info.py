"""``memrt info``: versions, devices, launcher, settings and whether env activation is installed."""

from __future__ import annotations

import argparse
import json
import platform

from memrt._version import __version__
from memrt.config import AGREED_VARIABLES, NOT_USER_VARIABLES, TEST_ONLY_VARIABLES, load_config
from memrt.sizes import format_bytes
from memrt.launcher import discover_launch

__all__ = ["collect_info", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _devices() -> list[dict]:
    import psutil
    import torch

    devices = [{"name": "cpu", "kind": "cpu", "model": platform.processor() or platform.machine(),
                "capacity_bytes": psutil.virtual_memory().total, "cores": psutil.cpu_count()}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"name": f"cuda:{i}", "kind": "cuda", "model": props.name,
                            "capacity_bytes": props.total_memory})
    return devices


def _autoload_installed() -> bool:
    from memrt.activation.install import autoload_installed

    return autoload_installed()


def collect_info() -> dict:
    """Everything ``memrt info`` shows, as a JSON-ready dict. Raises ConfigError on bad settings: the same
    ones a run rejects at start (:mod:`memrt.activation.checks`: budget beyond the device, report folder)."""
    import torch

    from memrt.activation.checks import default_report_problem, startup_errors

    config = load_config()
    launch = discover_launch()
    errors = startup_errors(config, launch.local_rank)
    if errors:
        raise errors[0]
    return {
        "version": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "launcher": launch.launcher,
        "rank": launch.rank,
        "world_size": launch.world_size,
        "local_rank": launch.local_rank,
        "local_world_size": launch.local_world_size,
        "devices": _devices(),
        "config": config.effective(),
        "same_on_every_rank": list(AGREED_VARIABLES),
        "test_only": list(TEST_ONLY_VARIABLES),
        "not_user": dict(NOT_USER_VARIABLES),
        "report_problem": default_report_problem(config),
        "autoload_installed": _autoload_installed(),
    }


def run(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"memrt {info['version']}  torch {info['torch']}  python {info['python']}")
    print(f"launcher: {info['launcher']}  rank {info['rank']}/{info['world_size']}  "
          f"local {info['local_rank']}/{info['local_world_size']}")
    print("devices:")
    for d in info["devices"]:
        print(f"  {d['name']:<8} {d['model']:<30} {format_bytes(d['capacity_bytes'])}")
    print(f"env activation (MEMRT=1) installed: {'yes' if info['autoload_installed'] else 'no'}")
    print("settings (ranks: 'same' = every rank of a job must use the same value, checked at start-up):")
    print(f"  {'variable':<20} {'value':<24} {'source':<12} ranks")
    for var, item in info["config"].items():
        ranks = "same" if var in info["same_on_every_rank"] else "per rank"
        if var in info["not_user"]:  # listed only when set: a testing aid or set by a command, not a user setting
            ranks += f" ({info['not_user'][var]})"
        print(f"  {var:<20} {str(item['value']):<24} {item['source']:<12} {ranks}")
    if info["report_problem"]:
        print(f"note: a run here would write no report ({info['report_problem']}); set MEMRT_REPORT_DIR")
    return 0
