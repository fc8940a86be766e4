"""``memrt info``: versions, devices, launcher, settings and whether env activation is installed."""

from __future__ import annotations

import argparse
import json
import platform

from memrt._version import __version__
from memrt.config import format_bytes, load_config
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
    try:
        from memrt.activation.install import autoload_installed
    except ImportError:
        return False
    return autoload_installed()


def collect_info() -> dict:
    """Everything ``memrt info`` shows, as a JSON-ready dict. Raises ConfigError on bad settings."""
    import torch

    config = load_config()
    launch = discover_launch()
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
    print("settings:")
    print(f"  {'variable':<20} {'value':<24} source")
    for var, item in info["config"].items():
        print(f"  {var:<20} {str(item['value']):<24} {item['source']}")
    return 0
