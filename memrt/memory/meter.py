"""Device memory meters: one interface over the CPU tracker and CUDA's allocator statistics.

A meter measures live tensor bytes on the model's device (the budget's quantity), the peak of each
segment between two marks, and the "ghost" peak (CPU only: what a unit would hold if its saved tensors
were kept). CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` with
``reset_peak_memory_stats`` at every mark (host-side counters, no device synchronisation); the step's
peak that certification compares with the budget is the higher of that and ``max_memory_reserved``. Both
raise a segment's peak to the device's own reading where it rose in that segment (CPU: the kernel's
resident high-water mark; CUDA: reserved bytes), so memory outside the tensors enters the memory model.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Iterable

import torch

__all__ = ["Meter", "CpuMeter", "ResidentPeak", "status_bytes", "CudaMeter", "CudaStats", "make_meter",
           "device_capacity_bytes", "known_tensors", "watch_optimizers", "on_optimizer_step", "owns_parameters",
           "resident_bytes"]


class Meter:
    """Interface; see module docstring."""

    exact_ghosts = False

    def start(self, extra: Iterable[Any] = ()) -> None: ...
    def stop(self) -> None: ...
    def live(self) -> int: raise NotImplementedError
    def segment(self) -> tuple[int, int]: raise NotImplementedError
    def ghost(self, t: torch.Tensor) -> None: ...
    def clear_ghosts(self) -> None: ...
    def mark(self, kind: str, label: str = "") -> None: ...
    def pause(self) -> None: ...
    def track(self, tensors: Iterable[Any]) -> None: ...
    @property
    def peak(self) -> int: raise NotImplementedError
    @property
    def valid(self) -> bool:
        """False when the reading does not stand for the step (torch compiled during it): measure again."""
        return True
    @property
    def resident_peak(self) -> int | None:
        """The step's peak as the process's resident memory shows it; None where this meter reads none."""
        return None


def status_bytes(field: str) -> int | None:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None where there is none."""
    return _status_fields(field)[0]


def _status_fields(*fields: str) -> list[int | None]:
    """Size fields of ``/proc/self/status`` read at one moment, in bytes (None where a field is missing)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in fields:
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return [found.get(name) for name in fields]


def graphs_compiled() -> int:
    """A count that moves whenever torch compiles: dynamo's frames, and AOTAutograd / inductor, which compile
    a graph's backward lazily, in the first backward that runs it (dynamo's own counters stay still then).
    Compiling takes resident memory that is not a step's (0 before dynamo is imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(sum(sum(c.values()) for c in counters.values()))


class ResidentPeak:
    """The process's resident-memory peak over a step, from the kernel's high-water mark (``VmHWM``),
    which it never resets (a reset would change what ``ru_maxrss`` and ``VmHWM`` tell the user).

    When the mark rose during the step, the step's peak resident memory is the new mark, exactly; then
    :attr:`peak` = bytes of the tensors live at the start + (mark - resident bytes at the start): the
    tensor count's quantity, with what the count cannot see (allocator slack, library scratch such as
    convolution workspaces, buffers outside torch) included. When the mark did not rise (an earlier
    moment of the process was higher), the step's peak is unknown below it and :attr:`peak` is None.
    """

    def __init__(self, live_bytes: int) -> None:
        self.live0 = live_bytes
        self.rss0, self.hwm0 = _status_fields("VmRSS", "VmHWM")
        self.hwm: int | None = None
        self._seen = self.hwm0
        self._last: int | None = None

    def segment_peak(self, live_bytes: int) -> int | None:
        """The peak of the stretch since the previous call (or the start), in the same units as
        :attr:`peak`, where the mark rose during that stretch; None where it did not (the stretch stayed
        below an earlier moment of the process, so its resident peak is not known). ``live_bytes``: the
        tensors live now. Resident memory the step has added and kept beyond its tensors up to now (code
        pages and library state of first use, allocator arenas; the mark includes it too) is taken off: it is
        the process's from then on, not a transient, and no plan removes it; what the stretch held and gave
        back (an operator's scratch) stays. After :meth:`end`, the reading taken there, once."""
        if self.hwm is not None:
            last, self._last = self._last, None
            return last
        return self._stretch(live_bytes, *_status_fields("VmHWM", "VmRSS"))

    def _stretch(self, live_bytes: int, hwm: int | None, rss: int | None) -> int | None:
        """:meth:`segment_peak` from one reading of the mark and the resident size."""
        if None in (hwm, rss, self.rss0, self._seen) or hwm <= self._seen:
            return None
        self._seen = hwm
        kept = max(0, (rss - self.rss0) - (live_bytes - self.live0))
        return self.live0 + hwm - self.rss0 - kept

    def end(self, live_bytes: int | None = None) -> None:
        """Read the mark (the first call counts: the step ends when its optimizer has stepped); with
        ``live_bytes``, also the open stretch's reading, which :meth:`segment_peak` returns next (what the
        process does after the step is not the step's)."""
        if self.hwm is None:
            hwm, rss = _status_fields("VmHWM", "VmRSS")
            if live_bytes is not None:
                self._last = self._stretch(live_bytes, hwm, rss)
            self.hwm = hwm

    @property
    def peak(self) -> int | None:
        if None in (self.rss0, self.hwm0, self.hwm) or self.hwm <= self.hwm0:
            return None
        return self.live0 + self.hwm - self.rss0


SEGMENT_NOISE_BYTES = {"cpu": 1 << 20, "cuda": 2 << 20}
"""A segment's peak is raised to the device's reading only by more than this: below it the difference is
allocator granularity (CPU: pages and heap arenas; CUDA: the caching allocator's 2 MiB rounding) that
varies with the process's history, and a plan must not change with it (certification still measures the
whole step)."""


def _raised_to(peak: int, ghost: int, extra: int, device: str) -> tuple[int, int]:
    """A segment's (peak, ghost peak) of tensors raised by ``extra``, what the device's own reading of the
    segment showed above them (resident or reserved bytes), where that exceeds the device's noise."""
    if extra <= SEGMENT_NOISE_BYTES[device]:
        return peak, ghost
    return peak + extra, ghost + extra


class CpuMeter(Meter):
    exact_ghosts = True

    def __init__(self, *, record: bool = True, scan_gc: bool = False) -> None:
        from memrt.profiling.cpu_tracker import CpuMemoryTracker

        self.tracker = CpuMemoryTracker(record=record)
        self.scan_gc = scan_gc
        self.resident: ResidentPeak | None = None
        self._graphs = self._graphs_at_start = 0
        self._graphs_at_end: int | None = None

    def start(self, extra: Iterable[Any] = ()) -> None:
        self.tracker.start(extra, scan_gc=self.scan_gc)
        self.resident = ResidentPeak(self.tracker.live_bytes)
        self._graphs = self._graphs_at_start = graphs_compiled()
        self._graphs_at_end = None

    def stop(self) -> None:
        self._end_step()
        self.tracker.stop()

    def pause(self) -> None:
        """Stop counting new tensors; frees of counted ones still lower the live bytes."""
        self.tracker.pause()
        self._end_step()

    def _end_step(self) -> None:
        if self.resident is not None:
            self.resident.end(self.tracker.live_bytes)
        if self._graphs_at_end is None:
            self._graphs_at_end = graphs_compiled()

    @property
    def valid(self) -> bool:
        """False when torch compiled during the step: the compiler's memory is in the resident reading and not
        all of the compiled code's buffers are counted (the step is measured again)."""
        end = self._graphs_at_end if self._graphs_at_end is not None else graphs_compiled()
        return end == self._graphs_at_start

    @property
    def resident_peak(self) -> int | None:
        """The step's peak as resident memory shows it (:class:`ResidentPeak`), None where not known or where
        torch compiled during the step."""
        if self.resident is None or not self.valid:
            return None
        return self.resident.peak

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors now (those not counted yet)."""
        self.tracker.track(tensors)

    def live(self) -> int:
        return self.tracker.live_bytes

    def segment(self) -> tuple[int, int]:
        """(peak, ghost peak) of the tensors since the previous segment or mark, each raised by what resident
        memory showed above the tensors in that stretch where the process's mark rose in it: scratch a
        library holds outside torch's tensors inside an operator (oneDNN's convolution backward) is then
        part of the unit's transient, and the plan made from the profile accounts for it."""
        peak, ghost = self.tracker.segment()
        high = self.resident.segment_peak(self.tracker.live_bytes) if self.resident is not None else None
        graphs, self._graphs = self._graphs, graphs_compiled()
        if graphs != self._graphs:  # torch compiled in this stretch: the rise is the compiler's
            high = None
        return _raised_to(peak, ghost, 0 if high is None else high - peak, "cpu")

    def ghost(self, t: torch.Tensor) -> None:
        self.tracker.ghost(t)

    def clear_ghosts(self) -> None:
        self.tracker.clear_ghosts()

    def mark(self, kind: str, label: str = "") -> None:
        if self.resident is not None:  # a mark drops the stretch's peak (as the tracker's): so is its rise
            self.resident.segment_peak(self.tracker.live_bytes)
            self._graphs = graphs_compiled()
        self.tracker.mark(kind, label)

    @property
    def peak(self) -> int:
        return self.tracker.peak_bytes


class CudaStats:
    """The allocator statistics a :class:`CudaMeter` reads (``torch.cuda``'s for one device); tests pass
    a stand-in with the same methods."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        """Return the allocator's free cached blocks to the device, so reserved bytes start at what live
        tensors hold (a keep-everything step before would otherwise count in the next step's peak)."""
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()


class CudaMeter(Meter):
    """Live bytes and segment peaks from the allocator's allocated bytes, a segment's raised by the reserved
    bytes it newly needed (:meth:`segment`); :attr:`peak`, what certification compares with the budget,
    covers the allocator's reserved bytes (``max_memory_reserved``: allocated blocks plus the cached and
    fragmented ones, what decides an out-of-memory error)."""

    def __init__(self, device: torch.device, *, record: bool = True, stats: CudaStats | None = None) -> None:
        self.device = device
        self.record = record
        self.stats = stats if stats is not None else CudaStats(device)
        self._peak = 0
        self._reserved_seen = 0
        self._paused_at: int | None = None

    def start(self, extra: Iterable[Any] = ()) -> None:
        self.stats.release_cached()
        self.stats.reset_peaks()
        self._peak = max(self.stats.allocated(), self.stats.reserved())
        self._reserved_seen = self.stats.reserved()
        self._paused_at = None

    def _max_now(self) -> int:
        return max(self.stats.max_allocated(), self.stats.max_reserved())

    def pause(self) -> None:
        """Freeze the peaks here (the allocator's counters keep moving with everything else's)."""
        if self._paused_at is None:
            self._peak = max(self._peak, self._max_now())
            self._paused_at = self.stats.max_allocated()

    def live(self) -> int:
        return self.stats.allocated()

    def segment(self) -> tuple[int, int]:
        """Allocated bytes' peak since the previous segment, raised by what the allocator newly reserved in
        it beyond those bytes (blocks rounded up, fragmentation; at most the growth of reserved bytes, so
        blocks cached by earlier segments are not charged to this one): the memory model then plans for
        what decides an out-of-memory error, as certification measures it. After :meth:`pause`, the frozen
        allocated peak (what follows the optimizer step is not the step's)."""
        if self._paused_at is not None:
            return self._paused_at, self._paused_at
        p, r = self.stats.max_allocated(), self.stats.max_reserved()
        self._peak = max(self._peak, p, r)
        self.stats.reset_peaks()
        extra = min(r - p, r - self._reserved_seen)
        self._reserved_seen = max(self._reserved_seen, r)
        return _raised_to(p, p, extra, "cuda")

    def mark(self, kind: str, label: str = "") -> None:
        p, _ = self.segment()
        if self.record:
            from memrt.profiling.recorder import get_recorder

            live = self.live()
            if p > live:
                get_recorder().record_memory(p, "peak", label)
            get_recorder().record_memory(live, kind, label)

    @property
    def peak(self) -> int:
        """Highest of allocated and reserved bytes since :meth:`start` (until :meth:`pause`)."""
        if self._paused_at is not None:
            return self._peak
        return max(self._peak, self._max_now())


_OPTIMIZERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOKED: list[Any] = []
_STEP_END: list[Any] = []


def _seen_optimizer(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _OPTIMIZERS.add(opt)


def _stepped(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for fn in list(_STEP_END):
        fn(opt)


def watch_optimizers() -> None:
    """Remember every optimizer that steps and tell :func:`on_optimizer_step` listeners when one has
    stepped (global step pre- and post-hooks, installed once)."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(_seen_optimizer))
        _HOOKED.append(register_optimizer_step_post_hook(_stepped))


def on_optimizer_step(fn: Any) -> None:
    """Call ``fn(optimizer)`` after every optimizer step (once per ``fn``)."""
    watch_optimizers()
    if fn not in _STEP_END:
        _STEP_END.append(fn)


def owns_parameters(opt: torch.optim.Optimizer, param_ids: set[int]) -> bool:
    """Whether ``opt`` steps any parameter whose ``id`` is in ``param_ids``."""
    return any(id(p) in param_ids for g in opt.param_groups for p in g["params"])


def known_tensors(model: torch.nn.Module | None, inputs: Iterable[Any] = ()) -> list[torch.Tensor]:
    """Tensors live at a step boundary without a gc scan: the model's parameters, gradients and buffers,
    the inputs, and the state of every optimizer seen stepping any of those parameters."""
    out: list[torch.Tensor] = [t for t in inputs if isinstance(t, torch.Tensor)]
    if model is None:
        return out
    params = list(model.parameters())
    out += params
    out += [p.grad for p in params if p.grad is not None]
    out += list(model.buffers())
    ids = {id(p) for p in params}
    for opt in list(_OPTIMIZERS):
        if not any(id(p) in ids for g in opt.param_groups for p in g["params"]):
            continue
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    out.append(v)
    return out


def make_meter(device: torch.device, *, record: bool = True) -> Meter:
    if device.type == "cuda":
        return CudaMeter(device, record=record)
    if device.type == "cpu":
        return CpuMeter(record=record)
    raise ValueError(f"memrt's memory planner supports cpu and cuda devices, not {device.type!r}")


def device_capacity_bytes(device: torch.device) -> int | None:
    """Total memory of the device (CUDA: the GPU's; CPU: the machine's RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def now() -> float:
    return time.perf_counter()
