"""Offload choices for the planner: one :class:`UnitOption` per (action, tier) with its costs.

Cost model (per unit, per step), from measured bandwidths (:mod:`.bandwidth`):

- moved bytes ``M``: what the action sends to the tier (all offloadable saved bytes for
  ``offload_<tier>``; the unit's inputs for ``recompute+offload_<tier>``).
- transfer times ``t_out = M / bw_out`` (device->tier) and ``t_in = M / bw_in`` (tier->device).
- overlap: the write runs behind the compute that follows the pack (the unit's own forward and
  the next unit's), the prefetch behind the backward of the unit after it; only an ``efficiency``
  share of that compute hides transfers (CPU: the I/O thread competes for the same cores, 0.5;
  CUDA copy engines: 0.9). Exposed time = ``max(0, t - efficiency * window)``
  (the usual compute/transfer overlap bound, as in ZeRO-Offload's and Capuchin's cost models).
- ``added_seconds`` = exposed write + exposed read (+ the forward replay for ``recompute+``).
- ``resident_bytes``: what stays on the device from the unit's forward to its backward.
- ``backward_transient_bytes``: what exists on the device only while the unit's backward runs
  (loaded data; for ``recompute+`` also the replayed activations).
- ``inflight_bytes``: this unit's data on the device outside its own backward while transfers are
  in flight (its prefetch lands during the backward of the unit after it; its writes are pending
  during the forward of the next unit). The planner adds it to the neighbour's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from memrt.memory.offload.bandwidth import Bandwidths
from memrt.memory.options import UnitOption
from memrt.memory.profile import UnitProfile

__all__ = ["OFFLOAD_ACTIONS", "UnitCosts", "offload_options", "UnitOption"]

OFFLOAD_ACTIONS = ("offload_disk", "offload_host", "recompute+offload_disk", "recompute+offload_host")


@dataclass(kw_only=True, slots=True, frozen=True)
class UnitCosts:
    """What the offload cost model reads of one unit call (a :class:`memrt.memory.profile.UnitProfile` gives
    all of it; :meth:`of` also takes any object with at least ``saved_bytes`` and ``forward_seconds``)."""

    saved_bytes: int
    """Bytes autograd saves for backward inside the unit."""
    forward_seconds: float
    """Seconds of the unit's forward (it hides the writes, and a recompute repeats it)."""
    backward_seconds: float | None = None
    """Seconds of the unit's backward (it hides the prefetch); None: twice the forward."""
    offloadable_bytes: int | None = None
    """Saved bytes that can leave the device (at most ``saved_bytes``); None: all of them."""
    input_bytes: int | None = None
    """Bytes of the unit's tensor inputs, what ``recompute+offload_<tier>`` moves; None or 0: no such option."""
    saved_not_input_bytes: int | None = None
    """Saved bytes that are not inputs; None: ``saved_bytes - input_bytes``."""
    backward_transient_bytes: int = 0
    """Peak above the backward's start after the recompute, as measured with the unit recomputed."""
    backward_recompute_transient_bytes: int = 0
    """Peak above the backward's start while the unit replays its forward."""
    forward_keep_transient_bytes: int | None = None
    """Peak above the forward's start when the unit's saved tensors are kept (None: not measured)."""
    forward_recompute_transient_bytes: int | None = None
    """Peak above the forward's start when nothing is kept (None: not measured)."""

    @classmethod
    def of(cls, unit: UnitProfile | UnitCosts | Any) -> UnitCosts:
        """The costs of ``unit``: a :class:`UnitCosts`, a :class:`UnitProfile`, or another object with attributes
        named as this class's fields (``saved_bytes`` and ``forward_seconds`` at least; None counts as absent)."""
        if isinstance(unit, UnitCosts):
            return unit
        if isinstance(unit, UnitProfile):
            return cls(saved_bytes=unit.saved_bytes, forward_seconds=unit.forward_seconds,
                       input_bytes=unit.input_bytes, saved_not_input_bytes=unit.saved_not_input_bytes,
                       backward_transient_bytes=unit.backward_transient_bytes,
                       backward_recompute_transient_bytes=unit.backward_recompute_transient_bytes,
                       forward_keep_transient_bytes=unit.forward_keep_transient_bytes,
                       forward_recompute_transient_bytes=unit.forward_recompute_transient_bytes)
        values = {f.name: getattr(unit, f.name) for f in fields(cls) if getattr(unit, f.name, None) is not None}
        missing = [name for name in ("saved_bytes", "forward_seconds") if name not in values]
        if missing:
            raise TypeError(f"unit profile {type(unit).__name__} has no {', '.join(missing)}: offload_options "
                            f"takes a memrt.memory.profile.UnitProfile, a UnitCosts, or an object with those "
                            f"attributes")
        return cls(**values)


def _efficiency(device: torch.device) -> float:
    return 0.9 if device.type == "cuda" else 0.5


def offload_options(unit_profile: UnitProfile | UnitCosts, bandwidths: Bandwidths, device: str | torch.device, *,
                    tiers: Sequence[str] | None = None, include_recompute: bool = True,
                    next_forward_seconds: float | None = None,
                    next_backward_seconds: float | None = None) -> list[UnitOption]:
    """Offload options for one unit call. ``tiers`` defaults to ('disk', 'host') on CUDA, ('disk',) elsewhere.

    ``unit_profile`` is a :class:`memrt.memory.profile.UnitProfile` (``saved_bytes``, ``input_bytes``,
    ``saved_not_input_bytes``, ``forward_seconds``, the measured transients) or a :class:`UnitCosts`; a
    profile-like object with only ``saved_bytes`` and ``forward_seconds`` (optionally other fields of
    :class:`UnitCosts`) works too (:meth:`UnitCosts.of`). ``next_*_seconds``: compute of the
    neighbouring units that also hides transfers (default: same as this unit).
    """
    device = torch.device(device)
    allowed = tuple(tiers) if tiers is not None else (("disk", "host") if device.type == "cuda" else ("disk",))
    if device.type != "cuda":
        allowed = tuple(t for t in allowed if t != "host")  # host memory is the device memory on CPU
    u = UnitCosts.of(unit_profile)
    saved = int(u.saved_bytes)
    offloadable = int(min(saved, u.offloadable_bytes if u.offloadable_bytes is not None else saved))
    fwd = float(u.forward_seconds)
    bwd = float(u.backward_seconds if u.backward_seconds is not None else 2.0 * fwd)
    inputs = u.input_bytes
    saved_not_input = int(u.saved_not_input_bytes if u.saved_not_input_bytes is not None
                          else max(0, saved - int(inputs or 0)))
    bwd_after = int(u.backward_transient_bytes)  # measured with the unit recomputed
    bwd_replay = int(u.backward_recompute_transient_bytes)
    fwd_keep = u.forward_keep_transient_bytes
    fwd_rec = u.forward_recompute_transient_bytes
    fwd_window = fwd + (fwd if next_forward_seconds is None else next_forward_seconds)
    bwd_window = bwd if next_backward_seconds is None else next_backward_seconds
    eff = _efficiency(device)
    out: list[UnitOption] = []
    for tier in allowed:
        if tier == "host":
            if bandwidths.d2h_bytes_per_s is None or bandwidths.h2d_bytes_per_s is None:
                continue
            bw_out, bw_in = bandwidths.d2h_bytes_per_s, bandwidths.h2d_bytes_per_s
        elif tier == "disk":
            bw_out, bw_in = bandwidths.disk_write_bytes_per_s, bandwidths.disk_read_bytes_per_s
            if device.type == "cuda" and bandwidths.d2h_bytes_per_s:
                # the disk tier on CUDA copies synchronously through host memory first
                bw_out = 1.0 / (1.0 / bw_out + 1.0 / bandwidths.d2h_bytes_per_s)
                bw_in = 1.0 / (1.0 / bw_in + 1.0 / bandwidths.h2d_bytes_per_s)
        else:
            raise ValueError(f"unknown offload tier {tier!r} (expected disk or host)")

        def exposed(nbytes: int) -> float:
            t_out, t_in = nbytes / bw_out, nbytes / bw_in
            if tier == "disk" and device.type == "cuda":  # synchronous device copies are not hidden
                return t_out + t_in
            return max(0.0, t_out - eff * fwd_window) + max(0.0, t_in - eff * bwd_window)

        if offloadable > 0:
            # forward: saved tensors leave as they are written; at worst (writes lagging) like keeping
            fwd_t = None
            if fwd_rec is not None and fwd_keep is not None:
                fwd_t = int(min(int(fwd_keep), int(fwd_rec) + offloadable))
            out.append(UnitOption(
                action=f"offload_{tier}", resident_bytes=saved - offloadable,
                added_seconds=exposed(offloadable),
                # backward: the loaded activations plus the temporaries a kept unit has
                backward_transient_bytes=offloadable + max(0, bwd_after - saved_not_input),
                inflight_bytes=offloadable, forward_transient_bytes=fwd_t, moved_bytes=offloadable))
        if include_recompute and inputs is not None and int(inputs) > 0:
            moved = int(inputs)
            out.append(UnitOption(
                action=f"recompute+offload_{tier}", resident_bytes=0, added_seconds=fwd + exposed(moved),
                # backward: the input comes back, then the unit replays as with plain recompute
                backward_transient_bytes=moved + max(bwd_replay, bwd_after, saved_not_input),
                inflight_bytes=moved, forward_transient_bytes=None if fwd_rec is None else int(fwd_rec),
                moved_bytes=moved))
    return out
