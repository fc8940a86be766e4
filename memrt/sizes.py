"""Byte sizes as people read them: the project's one formatter (binary units, as torch and nvidia-smi print)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float | None) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``: the project's one byte format (``-``: not measured)."""
    if n is None or n != n:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
