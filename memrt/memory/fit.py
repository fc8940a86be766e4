"""The fit-the-device budget: what ``MEMRT=1`` plans for on a GPU when ``MEMRT_BUDGET`` is unset.

The memory this process can use on its GPU when memrt attaches to a model is what the driver reports free
(``torch.cuda.mem_get_info``) plus what this process's caching allocator already reserves (the model's
parameters, DDP's buckets: the budget is compared with ``torch.cuda.max_memory_reserved``, which counts
them). The budget is that less a margin: :func:`margin_bytes`. On a CPU there is no device capacity to fit
(other processes share the machine's RAM): no fit, no plan.

``MEMRT_TEST_DEVICE_FREE`` (test only) stands in for the usable memory on any device, so that CPU tests
exercise the same arithmetic and the same plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memrt.sizes import format_bytes

__all__ = ["DeviceFit", "MARGIN_PERCENT", "MARGIN_FLOOR_BYTES", "margin_bytes", "device_fit"]

MARGIN_PERCENT = 5
"""Share of the usable memory held back, in percent: the allocator's fragmentation (reserved blocks that a
step's request of another size cannot use) grows with the memory in play, as does the planner's error on
a large step."""
MARGIN_FLOOR_BYTES = 512 * 2**20
"""The least held back, in bytes: what a step needs outside the caching allocator or after memrt measured
the free memory does not shrink with the GPU: CUDA kernels loaded lazily at their first launch (the first
backward's), NCCL's communicator buffers (created at the first collective), cuDNN/cuBLAS handles, another
process on the same GPU allocating meanwhile. Some hundreds of MiB on current stacks; 5% of a small GPU is
less than that."""


def margin_bytes(usable_bytes: int) -> int:
    """Bytes held back from ``usable_bytes``: the larger of :data:`MARGIN_PERCENT` % (rounded up) and
    :data:`MARGIN_FLOOR_BYTES`."""
    if usable_bytes < 0:
        raise ValueError(f"usable_bytes must be >= 0, got {usable_bytes}")
    return max(-(-usable_bytes * MARGIN_PERCENT // 100), MARGIN_FLOOR_BYTES)


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """A fit-the-device budget and the figures it came from."""

    device: str
    """The device measured, e.g. ``cuda:0`` (the model's)."""
    free_bytes: int
    """Bytes free on the device when memrt attached (``torch.cuda.mem_get_info``), or the test figure."""
    reserved_bytes: int = 0
    """Bytes this process's caching allocator reserved then (usable by this process too); 0 for the test figure."""
    test_figure: bool = False
    """True when ``free_bytes`` is ``MEMRT_TEST_DEVICE_FREE`` (test only), not measured."""

    @property
    def usable_bytes(self) -> int:
        """Bytes this process can use on the device: free plus reserved."""
        return self.free_bytes + self.reserved_bytes

    @property
    def margin_bytes(self) -> int:
        """Bytes held back (:func:`margin_bytes`)."""
        return margin_bytes(self.usable_bytes)

    @property
    def budget_bytes(self) -> int:
        """The budget: usable less the margin (at least 1 byte: a device with less free memory than the
        margin gets a budget no step fits, and so the planner's error naming the smallest feasible one)."""
        return max(1, self.usable_bytes - self.margin_bytes)

    def margin_text(self) -> str:
        """``5% margin`` where the share decides it, else ``512.00 MiB margin``."""
        if self.margin_bytes > MARGIN_FLOOR_BYTES:
            return f"{MARGIN_PERCENT}% margin"
        return f"{format_bytes(self.margin_bytes)} margin"

    def describe(self) -> str:
        """``fit the device: 71.30 GiB free, 5% margin -> 67.74 GiB`` (``free`` counts this process's reserved
        memory; a test figure is named as such)."""
        free = format_bytes(self.usable_bytes) + (" free (MEMRT_TEST_DEVICE_FREE)" if self.test_figure else " free")
        return f"fit the device: {free}, {self.margin_text()} -> {format_bytes(self.budget_bytes)}"

    def to_dict(self) -> dict[str, object]:
        return {"device": self.device, "free_bytes": self.free_bytes, "reserved_bytes": self.reserved_bytes,
                "test_figure": self.test_figure, "margin_bytes": self.margin_bytes,
                "budget_bytes": self.budget_bytes, "text": self.describe()}


def device_fit(device: torch.device | str, *, test_free_bytes: int | None = None) -> DeviceFit | None:
    """The fit-the-device budget of ``device`` now: from ``test_free_bytes`` when given (any device), else
    from the GPU's free and this process's reserved memory; None on a CPU (nothing to fit)."""
    device = torch.device(device)
    if test_free_bytes is not None:
        return DeviceFit(device=str(device), free_bytes=int(test_free_bytes), test_figure=True)
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free, _total = torch.cuda.mem_get_info(device)
    return DeviceFit(device=str(device), free_bytes=int(free), reserved_bytes=int(torch.cuda.memory_reserved(device)))
