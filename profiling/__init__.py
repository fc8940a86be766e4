"""memrt.profiling: memory timelines, comm stats, traces, reports."""
