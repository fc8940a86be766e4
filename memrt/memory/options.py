"""The vocabulary between the planner and what plugs options into it (offload tiers, registered actions).

A :class:`UnitOption` is one way to treat a unit call with its costs; the planner chooses one option per
call, the offload tiers and registered actions propose theirs. An :class:`OptionSource` is a plug-in's
offer to the planner (:func:`register_options`): the offload tiers register theirs when
:mod:`memrt.memory.offload` is imported. This module lives below both, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["OptionSource", "UnitOption", "option_sources", "register_options"]


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


@dataclass(frozen=True, slots=True)
class OptionSource:
    """Options a plug-in adds to the planner's keep and recompute, and its say over the finished plan."""

    name: str
    """Which ``offload=`` settings it serves: "offload" serves auto, disk and host."""
    propose: Callable[[Any, str, Any, Any], Callable[[Any], Sequence[UnitOption]] | None]
    """``propose(profile, offload, bandwidths, config)``: a function of a unit profile to its options, or None
    when nothing is usable in this process (no CUDA for host, no usable folder for disk). ``config``: the
    settings the plan is made under (None: the environment's)."""
    admit: Callable[[Any, Any], bool]
    """``admit(plan, config)``: False when the plan cannot be carried out as made (e.g. no room in the folder),
    after the source has stopped proposing what failed: the planner then plans again."""


_SOURCES: dict[str, OptionSource] = {}


def register_options(source: OptionSource) -> None:
    """Add (or replace, by name) a source of options for the planner."""
    _SOURCES[source.name] = source


def option_sources() -> tuple[OptionSource, ...]:
    """The registered sources, in registration order."""
    return tuple(_SOURCES.values())
