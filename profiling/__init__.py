"""memrt.profiling: memory timelines, comm stats, traces, reports.

Importing this package does not import torch or matplotlib (``memrt report`` runs without them);
the functions that need torch import it when called.
"""

from memrt.profiling.comm_log import CommRow, busbw_factor, straggler_view, summarize_comm, timed
from memrt.profiling.marks import UnitMarker, default_live_bytes, default_units
from memrt.profiling.recorder import CommRecord, MemoryEvent, Recorder, TraceEvent, get_recorder
from memrt.profiling.steps import StepSplit, step_split
from memrt.profiling.timeline import MemoryTimeline, PeakAttribution, StepMemory, analyze_memory
from memrt.profiling.trace import chrome_trace, memrt_range, write_chrome_trace

__all__ = [
    "CommRecord",
    "CommRow",
    "MemoryEvent",
    "MemoryTimeline",
    "PeakAttribution",
    "Recorder",
    "StepMemory",
    "StepSplit",
    "TraceEvent",
    "UnitMarker",
    "analyze_memory",
    "busbw_factor",
    "chrome_trace",
    "configure",
    "default_live_bytes",
    "default_units",
    "get_recorder",
    "memrt_range",
    "step_split",
    "straggler_view",
    "summarize_comm",
    "timed",
    "write_chrome_trace",
]


def configure(*, enabled: bool | None = None, exact_timing: bool | None = None) -> Recorder:
    """Switch the process-wide recorder on/off and pick the timing mode; returns the recorder.

    ``exact_timing=True`` synchronizes the device around each timed collective (see
    docs/sections/profiling.md for what it costs); the default reads CUDA events lazily.
    """
    rec = get_recorder()
    rec.configure(enabled=enabled, exact_timing=exact_timing)
    return rec
