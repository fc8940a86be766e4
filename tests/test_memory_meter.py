"""CudaMeter on a stand-in allocator (no GPU needed): certification's peak covers reserved bytes."""

from __future__ import annotations

import torch

from memrt.memory.meter import CudaMeter

MiB = 2**20


class FakeAllocator:
    """Allocated and reserved bytes with their peaks since the last reset, like torch.cuda's counters."""

    def __init__(self) -> None:
        self.alloc = self.res = self.max_alloc = self.max_res = 0

    def set(self, alloc: int, res: int) -> None:
        self.alloc, self.res = alloc, max(res, alloc)
        self.max_alloc, self.max_res = max(self.max_alloc, self.alloc), max(self.max_res, self.res)

    def allocated(self) -> int:
        return self.alloc

    def max_allocated(self) -> int:
        return self.max_alloc

    def reserved(self) -> int:
        return self.res

    def max_reserved(self) -> int:
        return self.max_res

    def reset_peaks(self) -> None:
        self.max_alloc, self.max_res = self.alloc, self.res

    def release_cached(self) -> None:
        self.res = self.alloc  # empty_cache: free cached blocks go back to the device


def test_cuda_meter_peak_is_max_reserved_and_segments_are_allocated():
    a = FakeAllocator()
    a.set(1 * MiB, 1 * MiB)
    m = CudaMeter(torch.device("cuda", 0), record=False, stats=a)
    m.start()
    a.set(5 * MiB, 8 * MiB)  # a unit's forward: 5 MiB allocated, the caching allocator holds 8
    a.set(2 * MiB, 8 * MiB)
    assert m.segment() == (8 * MiB, 8 * MiB)  # the memory model: allocated bytes, raised where reserved grew
    a.set(3 * MiB, 12 * MiB)  # fragmentation: reserved grows while allocated stays below the earlier peak
    a.set(1 * MiB, 12 * MiB)
    assert m.live() == 1 * MiB
    assert m.peak == 12 * MiB  # certification: what decides an out-of-memory error
    assert m.segment() == (12 * MiB, 12 * MiB)
    a.set(4 * MiB, 12 * MiB)  # blocks cached earlier serve it: reserved did not grow, the tensors decide
    a.set(1 * MiB, 12 * MiB)
    assert m.segment() == (4 * MiB, 4 * MiB)
    a.set(12 * MiB + 4096, 12 * MiB + 2 * 4096)  # reserved grew by a rounding: granularity, not a transient
    a.set(1 * MiB, 12 * MiB + 2 * 4096)
    assert m.segment() == (12 * MiB + 4096, 12 * MiB + 4096)
    m.pause()  # optimizer stepped: what happens after is not the step's
    a.set(20 * MiB, 30 * MiB)
    assert m.peak == 12 * MiB + 2 * 4096 and m.segment() == (1 * MiB, 1 * MiB)


def test_cuda_meter_allocated_peak_counts_when_nothing_is_cached():
    a = FakeAllocator()
    m = CudaMeter(torch.device("cuda", 0), record=False, stats=a)
    m.start()
    a.set(7000, 7000)
    a.set(0, 0)
    assert m.peak == 7000


def test_cuda_meter_start_drops_blocks_cached_by_an_earlier_step():
    """A keep-everything step leaves its blocks cached; the next step's peak counts only what it holds."""
    a = FakeAllocator()
    a.set(8000, 8000)  # the profiling step's peak
    a.set(1000, 8000)  # its activations freed, the blocks still reserved
    m = CudaMeter(torch.device("cuda", 0), record=False, stats=a)
    m.start()
    a.set(3000, 3000)
    a.set(1000, 3000)
    assert m.peak == 3000
