"""memrt's benchmarks: run each as ``python -m benchmarks.<name> [--quick]`` from the repository root.

Every benchmark measures memrt and the named baseline in the same run, prints ratios, and writes JSON
(and a PNG where it has a figure) under ``--out``. See docs/sections/benchmarks.md for the results.
"""
