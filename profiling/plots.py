"""PNG plots for ``memrt report`` (matplotlib, optional: ``pip install "memrt[plot]"``).

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, the user's backend untouched).
Each function writes one PNG of ``width_px`` x ``height_px`` pixels and returns its path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["PLOT_INSTALL_HINT", "have_matplotlib", "plot_comm", "plot_memory", "plot_plan", "plot_shares",
           "plot_step_split"]

PLOT_INSTALL_HINT = 'plots need matplotlib: pip install "memrt[plot]"'
_DPI = 100
_ACTION_COLORS = {"keep": "#4c72b0", "recompute": "#dd8452", "offload_host": "#55a868", "offload_disk": "#8172b3"}
_MIB = 2**20


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width_px: int, height_px: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / _DPI, height_px / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=_DPI, format="png")  # no bbox 'tight': the pixel size stays as asked
    return path


def plot_memory(timelines: Mapping[int, Mapping[str, Any]], path: str | os.PathLike, *,
                budget_bytes: int | Mapping[Any, int | None] | None = None, width_px: int = 1000,
                height_px: int = 450) -> Path:
    """Live bytes over time per rank (``MemoryTimeline.to_dict()`` each), budget line(s) (one budget, or each
    rank's own), actions and peak."""
    fig = _figure(width_px, height_px)
    ax = fig.add_subplot(1, 1, 1)
    for rank, tl in sorted(timelines.items()):
        pts = tl.get("points", [])
        if not pts:
            continue
        xs = [p["t_s"] for p in pts]
        ys = [p["live_bytes"] / _MIB for p in pts]
        (line,) = ax.step(xs, ys, where="post", label=f"rank {rank}", linewidth=1.2)
        bounds = [p["t_s"] for p in pts if p["kind"] in ("unit_begin", "unit_end")]
        if bounds:  # unit boundaries as a rug along the bottom
            ax.plot(bounds, [0.0] * len(bounds), "|", color=line.get_color(), markersize=8, alpha=0.6,
                    label=f"unit boundaries (rank {rank})")
        for kind, marker in (("recompute", "^"), ("offload", "v"), ("prefetch", "o")):
            sel = [(p["t_s"], p["live_bytes"] / _MIB) for p in pts if p["kind"] == kind]
            if sel:
                ax.scatter(*zip(*sel), marker=marker, s=18, color=line.get_color(),
                           label=f"{kind} (rank {rank})")
        peak = tl.get("peak")
        if peak:
            ax.annotate(f"peak {peak['live_bytes'] / _MIB:.1f} MiB\n{peak['unit']} / {peak['phase'] or '?'}",
                        (peak["t_s"], peak["live_bytes"] / _MIB), textcoords="offset points", xytext=(6, 6),
                        fontsize=8, color=line.get_color())
            ax.axhline(peak["fixed_bytes"] / _MIB, color=line.get_color(), linestyle=":", linewidth=0.8)
    budgets = budget_bytes if isinstance(budget_bytes, Mapping) else {None: budget_bytes}
    for rank, budget in sorted(budgets.items(), key=lambda kv: -1 if kv[0] is None else int(kv[0])):
        if budget:  # one line per distinct rank budget (a share is a different size on each device)
            who = "" if rank is None or len(set(budgets.values())) == 1 else f" (rank {rank})"
            ax.axhline(budget / _MIB, color="red", linestyle="--", linewidth=1.2,
                       label=f"budget {budget / _MIB:.1f} MiB{who}")
            if not who:
                break
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("live bytes (MiB)")
    ax.set_title("memory timeline (dotted: fixed bytes at step start)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    fig.subplots_adjust(left=0.08, right=0.98, top=0.92, bottom=0.12)
    return _save(fig, path)


def plot_plan(plan: Mapping[str, Any], path: str | os.PathLike, *, width_px: int = 900,
              height_px: int | None = None) -> Path:
    """Per unit: bytes kept and bytes freed, coloured by action; budget and peaks in the title."""
    units = plan.get("units", [])
    height_px = height_px or max(300, 60 + 22 * len(units))
    fig = _figure(width_px, height_px)
    ax = fig.add_subplot(1, 1, 1)
    names = [u.get("name", str(i)) for i, u in enumerate(units)]
    kept = [u.get("bytes_kept", 0) / _MIB for u in units]
    freed = [u.get("bytes_freed", 0) / _MIB for u in units]
    colors = [_ACTION_COLORS.get(str(u.get("action", "keep")).split("+")[0], "#999999") for u in units]
    ys = range(len(units))
    ax.barh(ys, kept, color=colors, label="kept")
    ax.barh(ys, freed, left=kept, color=colors, alpha=0.3, hatch="//", label="freed")
    for y, u in zip(ys, units):
        ax.text(0, y, f" {u.get('action', '?')}", va="center", fontsize=7, color="white")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("activation bytes per unit (MiB)")
    parts = [f"{k.replace('_bytes', '')} {plan[k] / _MIB:.1f} MiB" for k in
             ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes") if plan.get(k)]
    ax.set_title("plan per unit" + (": " + ", ".join(parts) if parts else ""), fontsize=9)
    fig.subplots_adjust(left=0.22, right=0.98, top=1 - 30 / height_px, bottom=50 / height_px)
    return _save(fig, path)


def plot_comm(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, width_px: int = 900,
              height_px: int = 450) -> Path:
    """Mean time per call against size, one line per (op, algorithm, ranks); log-log."""
    fig = _figure(width_px, height_px)
    ax = fig.add_subplot(1, 1, 1)
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault((r["op"], r["algorithm"], r["group_size"]), []).append((r["size_bytes"], r["time_us"]))
    for (op, algo, n), pts in sorted(series.items()):
        pts.sort()
        ax.plot([max(p[0], 1) for p in pts], [p[1] for p in pts], marker="o", label=f"{op} {algo} x{n}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes, nccl-tests definition)")
    ax.set_ylabel("time per call (us)")
    ax.set_title("collective time per size")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.92, bottom=0.12)
    return _save(fig, path)


def plot_step_split(splits: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, width_px: int = 900,
                    height_px: int | None = None) -> Path:
    """Per rank (``StepSplit`` dicts): mean step time as a bar split into collectives and the rest (ms)."""
    height_px = height_px or max(240, 120 + 40 * len(splits))
    fig = _figure(width_px, height_px)
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(len(splits)))
    for y, s in zip(ys, splits):
        step = s.get("step_seconds")
        if step is None:
            continue
        if s.get("comm_seconds") is None:
            ax.barh(y, 1e3 * step, color="#bbbbbb", label="step (split not recorded)" if y == ys[0] else None)
            continue
        comm = 1e3 * s["comm_seconds"]
        other = 1e3 * s["other_seconds"]
        ax.barh(y, other, color="#4c72b0", label="compute, data and other (not recorded separately)" if y == 0 else None)
        ax.barh(y, comm, left=other, color="#dd8452", label="in collectives (incl. waits for peers)" if y == 0 else None)
        ax.text(other + comm, y, f" {1e3 * step:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"rank {s['rank']}" for s in splits])
    ax.invert_yaxis()
    longest = max((1e3 * s["step_seconds"] for s in splits if s.get("step_seconds") is not None), default=0.0)
    ax.set_xlim(0, max(longest, 1e-3) * 1.15)  # room for the totals written after the bars
    ax.set_xlabel("mean time per step (ms)")
    ax.set_title("step time per rank", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # below the axes: never over a bar
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -45 / (height_px - 125)), ncol=2)
    fig.subplots_adjust(left=0.1, right=0.95, top=1 - 30 / height_px, bottom=95 / height_px)
    return _save(fig, path)


def plot_shares(decisions: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, width_px: int = 900,
                height_px: int = 480) -> Path:
    """Balance decisions over steps: each rank's share of the global batch (top) and its measured samples/s
    (bottom). A decision's shares are those in force after it (adopted or kept)."""
    fig = _figure(width_px, height_px)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    world = max((len(d.get("samples_per_s") or []) for d in decisions), default=0)
    for rank in range(world):
        pts = [(d["step"], d["shares"][rank]) for d in decisions
               if isinstance(d.get("shares"), list) and rank < len(d["shares"])]
        if pts:
            (line,) = top.step(*zip(*pts), where="post", marker="o", label=f"rank {rank}")
            changed = [(d["step"], d["shares"][rank]) for d in decisions
                       if d.get("changed") and isinstance(d.get("shares"), list) and rank < len(d["shares"])]
            if changed:
                top.scatter(*zip(*changed), s=70, facecolors="none", edgecolors=line.get_color())
        speeds = [(d["step"], d["samples_per_s"][rank]) for d in decisions
                  if rank < len(d.get("samples_per_s") or []) and d["samples_per_s"][rank] is not None]
        if speeds:
            bottom.plot(*zip(*speeds), marker="o", label=f"rank {rank}")
    top.set_ylabel("samples per global batch")
    top.set_title("balance: shares after each decision (circled: changed)", fontsize=10)
    bottom.set_ylabel("samples/s (own work)")
    bottom.set_xlabel("training step of the decision")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.subplots_adjust(left=0.1, right=0.98, top=0.93, bottom=0.1, hspace=0.3)
    return _save(fig, path)
