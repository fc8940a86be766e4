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

from typing import Any, Sequence

import torch

from memrt.memory.offload.bandwidth import Bandwidths
from memrt.memory.options import UnitOption

__all__ = ["OFFLOAD_ACTIONS", "offload_options", "UnitOption"]

OFFLOAD_ACTIONS = ("offload_disk", "offload_host", "recompute+offload_disk", "recompute+offload_host")

def _get(profile: Any, names: Sequence[str], default: Any = None) -> Any:
    for n in names:
        v = getattr(profile, n, None)
        if v is not None:
            return v
    if default is None:
        raise TypeError(f"unit profile {type(profile).__name__} has none of {', '.join(names)}")
    return default


def _efficiency(device: torch.device) -> float:
    return 0.9 if device.type == "cuda" else 0.5


def offload_options(unit_profile: Any, bandwidths: Bandwidths, device: str | torch.device, *,
                    tiers: Sequence[str] | None = None, include_recompute: bool = True,
                    next_forward_seconds: float | None = None,
                    next_backward_seconds: float | None = None) -> list[UnitOption]:
    """Offload options for one unit call. ``tiers`` defaults to ('disk', 'host') on CUDA, ('disk',) elsewhere.

    ``unit_profile`` is a :class:`memrt.memory.profile.UnitProfile` (``saved_bytes``, ``input_bytes``,
    ``saved_not_input_bytes``, ``forward_seconds``, the measured transients); a profile-like object
    with only ``saved_bytes`` and ``forward_seconds`` (optionally ``input_bytes``,
    ``offloadable_bytes``, ``backward_seconds``) works too. ``next_*_seconds``: compute of the
    neighbouring units that also hides transfers (default: same as this unit).
    """
    device = torch.device(device)
    allowed = tuple(tiers) if tiers is not None else (("disk", "host") if device.type == "cuda" else ("disk",))
    if device.type != "cuda":
        allowed = tuple(t for t in allowed if t != "host")  # host memory is the device memory on CPU
    u = unit_profile
    saved = int(_get(u, ("saved_bytes", "activation_bytes", "bytes_kept")))
    offloadable = int(min(saved, _get(u, ("offloadable_bytes",), saved)))
    fwd = float(_get(u, ("forward_seconds", "fwd_seconds")))
    bwd = float(_get(u, ("backward_seconds", "bwd_seconds"), 2.0 * fwd))
    inputs = getattr(u, "offloadable_input_bytes", None)
    if inputs is None:
        inputs = getattr(u, "input_bytes", None)
    saved_not_input = int(getattr(u, "saved_not_input_bytes", max(0, saved - int(inputs or 0))))
    bwd_after = int(getattr(u, "backward_transient_bytes", 0))  # measured with the unit recomputed
    bwd_replay = int(getattr(u, "backward_recompute_transient_bytes", 0))
    fwd_keep = getattr(u, "forward_keep_transient_bytes", None)
    fwd_rec = getattr(u, "forward_recompute_transient_bytes", None)
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
