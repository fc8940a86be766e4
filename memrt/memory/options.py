"""The vocabulary between the planner and what plugs options into it (offload tiers, registered actions).

A :class:`UnitOption` is one way to treat a unit call with its costs; the planner chooses one option per
call, the offload tiers and registered actions propose theirs. It lives below both so neither imports the
other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UnitOption"]


@dataclass(slots=True)
class UnitOption:
    """One way to treat a unit call, with its costs."""

    action: str
    """keep | recompute | offload_disk | offload_host | recompute+offload_<tier> | any registered action."""
    resident_bytes: int
    """Bytes the unit leaves on the device from its forward until its backward."""
    added_seconds: float
    """Time the option adds to a step (recompute: the forward again; offload: exposed transfers)."""
    backward_transient_bytes: int
    """Bytes above the resident ones while the unit's backward runs (recomputed / loaded tensors, temporaries)."""
    inflight_bytes: int = 0
    """Bytes of this unit on the device around the neighbouring unit (pending writes, early prefetch)."""
    forward_transient_bytes: int | None = None
    """Peak above the start of the unit's forward; None: recompute-mode transient + inflight + extra resident."""
    moved_bytes: int | None = None
    """Bytes sent off the device per step (offload); None: saved bytes less resident ones for offload actions."""
