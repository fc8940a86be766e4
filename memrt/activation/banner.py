"""The one banner rank 0 prints when memrt switches on: version, launcher, shape, every setting and its source."""

from __future__ import annotations

from pathlib import Path

from memrt._version import __version__
from memrt.config import NOT_USER_VARIABLES, MemrtConfig

__all__ = ["format_banner", "describe_nodes"]


def describe_nodes(world_size: int, nodes: tuple[tuple[int, ...], ...] | None) -> str:
    """``4 ranks = 2 nodes x 2`` (or ``3 ranks = 2 nodes (2+1)``; ``unknown`` shape without node data)."""
    if not nodes:
        return f"{world_size} rank{'s' if world_size != 1 else ''}, node shape unknown"
    sizes = [len(n) for n in nodes]
    n = len(nodes)
    shape = f"{n} node{'s' if n != 1 else ''} x {sizes[0]}" if len(set(sizes)) == 1 else \
        f"{n} nodes ({'+'.join(map(str, sizes))})"
    return f"{world_size} rank{'s' if world_size != 1 else ''} = {shape}"


def format_banner(*, config: MemrtConfig, launcher: str, world_size: int,
                  nodes: tuple[tuple[int, ...], ...] | None, nodes_source: str, backend: str,
                  run_id: str, report_dir: Path, budget: str | None = None) -> str:
    """The banner text (several lines, no trailing newline). ``budget``: what MEMRT_BUDGET's line says when it is
    unset (the fit-the-device budget, or that a CPU gets no plan: :func:`memrt.activation.budget.banner_value`)."""
    lines = [
        f"memrt {__version__} on | launcher {launcher} | {describe_nodes(world_size, nodes)}"
        f" ({nodes_source}) | backend {backend or '?'} | run {run_id}",
        f"memrt: report at exit -> {report_dir}",
        f"memrt: {'setting':<18} {'value':<22} source",
    ]
    for var, item in config.effective().items():
        value = "-" if item["value"] is None else str(item["value"])
        if var == "MEMRT_BUDGET" and item["value"] is None and budget:
            value = budget
        elif var in NOT_USER_VARIABLES:
            value += f" ({NOT_USER_VARIABLES[var]})"
        lines.append(f"memrt: {var:<18} {value:<22} {item['source']}")
    return "\n".join(lines)
