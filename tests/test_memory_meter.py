"""CudaMeter on a stand-in allocator (no GPU needed): certification's peak covers reserved bytes."""

from __future__ import annotations

import torch

from memrt.memory.meter import CudaMeter


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
    a.set(1000, 1000)
    m = CudaMeter(torch.device("cuda", 0), record=False, stats=a)
    m.start()
    a.set(5000, 6000)  # a unit's forward: 5000 allocated, the caching allocator holds 6000
    a.set(2000, 6000)
    assert m.segment() == (5000, 5000)  # the planner's memory model: allocated bytes
    a.set(3000, 9000)  # fragmentation: reserved grows while allocated stays below the earlier peak
    a.set(1500, 9000)
    assert m.live() == 1500
    assert m.peak == 9000  # certification: what decides an out-of-memory error
    m.segment()
    m.pause()  # optimizer stepped: what happens after is not the step's
    a.set(20000, 30000)
    assert m.peak == 9000 and m.segment() == (1500, 1500)


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
