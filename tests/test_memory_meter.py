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
    a.set(3 * MiB, 12 * MiB)  # fragmentation: reserved grows by 4 while allocated stays below the earlier peak
    a.set(1 * MiB, 12 * MiB)
    assert m.live() == 1 * MiB
    assert m.peak == 12 * MiB  # certification: what decides an out-of-memory error
    assert m.segment() == (7 * MiB, 7 * MiB)  # raised by the growth only: earlier cached blocks are not this one's
    a.set(4 * MiB, 12 * MiB)  # blocks cached earlier serve it: reserved did not grow, the tensors decide
    a.set(1 * MiB, 12 * MiB)
    assert m.segment() == (4 * MiB, 4 * MiB)
    a.set(13 * MiB, 14 * MiB)  # reserved grew by a rounding: granularity, not a transient
    a.set(1 * MiB, 14 * MiB)
    assert m.segment() == (13 * MiB, 13 * MiB)
    m.pause()  # optimizer stepped: what happens after is not the step's
    a.set(20 * MiB, 30 * MiB)
    assert m.peak == 14 * MiB and m.segment() == (1 * MiB, 1 * MiB)


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


def test_resident_segment_peak_reads_rises_and_leaves_kept_growth_out(monkeypatch):
    """CPU: a stretch's resident peak where the kernel's mark rose in it, less the resident growth the step kept
    beyond its tensors; none where an earlier moment was higher; after the step ends, the reading taken there."""
    import memrt.memory.meter as meter

    status = {"VmRSS": 100 * MiB, "VmHWM": 200 * MiB}  # an earlier moment of the process reached 200 MiB
    monkeypatch.setattr(meter, "_status_fields", lambda *fields: [status[f] for f in fields])
    r = meter.ResidentPeak(live_bytes=10 * MiB)
    status.update(VmRSS=150 * MiB)
    assert r.segment_peak(60 * MiB) is None  # below the old mark: unknown
    status.update(VmHWM=260 * MiB, VmRSS=115 * MiB)  # scratch took the mark to 260, then went; 10 MiB stayed
    assert r.segment_peak(15 * MiB) == 10 * MiB + (260 - 100) * MiB - 10 * MiB
    assert r.segment_peak(15 * MiB) is None  # the mark did not rise again
    status.update(VmHWM=270 * MiB, VmRSS=115 * MiB)
    r.end(15 * MiB)  # the optimizer stepped: the open stretch's reading is kept for its segment
    status.update(VmHWM=400 * MiB)  # what the process does after the step is not the step's
    assert r.segment_peak(15 * MiB) == 10 * MiB + (270 - 100) * MiB - 10 * MiB
    assert r.segment_peak(15 * MiB) is None
    assert r.peak == 10 * MiB + (270 - 100) * MiB


def test_segment_raised_only_beyond_the_device_noise():
    from memrt.memory.meter import SEGMENT_NOISE_BYTES, _raised_to

    assert _raised_to(50, 60, SEGMENT_NOISE_BYTES["cpu"], "cpu") == (50, 60)
    assert _raised_to(50, 60, 12 * MiB, "cpu") == (50 + 12 * MiB, 60 + 12 * MiB)
    assert _raised_to(50, 50, 2 * MiB, "cuda") == (50, 50)
