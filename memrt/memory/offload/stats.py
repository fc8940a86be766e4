"""What the offload engine moved and holds, host and disk memory apart from device memory."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadStats"]


@dataclass(kw_only=True, slots=True)
class OffloadStats:
    """What the engine moved and holds; host and disk memory apart from device memory."""

    tier: str
    """disk | host."""
    device: str
    """Device whose activations are offloaded."""
    directory: str | None
    """Private folder of the disk tier (None for host)."""
    tensors_offloaded: int
    """Saved tensors replaced by handles (cumulative)."""
    tensors_deduplicated: int
    """Of those, views of a storage stored already (no extra bytes moved)."""
    tensors_kept_small: int
    """Saved tensors kept on the device because they are below min_bytes."""
    tensors_kept_param: int
    """Saved tensors kept because they are parameters, views of them or registered storages."""
    bytes_offloaded: int
    """Bytes copied to the tier (cumulative)."""
    bytes_restored: int
    """Bytes copied back from the tier (cumulative)."""
    device_held_bytes: int
    """Device bytes held by the engine now (writes not yet done, loaded data not yet used)."""
    device_held_peak_bytes: int
    """Peak of device_held_bytes."""
    host_bytes: int
    """Host tier: pinned pool bytes in use now (0 for disk)."""
    host_peak_bytes: int
    """Host tier: peak pinned bytes in use."""
    host_pool_capacity_bytes: int
    """Host tier: pinned bytes allocated (pre-sized, reused)."""
    pinned_allocations: int
    """Host tier: pinned buffers ever allocated (stays constant after the first step when sized right)."""
    disk_bytes: int
    """Disk tier: bytes in files now."""
    disk_peak_bytes: int
    """Disk tier: peak bytes in files."""
    write_seconds: float
    """Disk tier: I/O thread time spent writing."""
    read_seconds: float
    """Disk tier: I/O thread time spent reading."""
    wait_seconds: float
    """Time the training thread waited for the tier (exposed, not overlapped, transfer time)."""
    prefetch_hits: int
    """Unpacks whose data was already loaded or on its way."""
    prefetch_misses: int
    """Unpacks that had to start the load themselves."""
