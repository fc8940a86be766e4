"""memrt.testing.launch.run_on_cluster: 2 namespaces x 2 ranks; discovery must find the two nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.root
@pytest.mark.slow
def test_run_on_cluster_discovers_two_nodes(emulated_cluster):
    from memrt.testing.launch import run_on_cluster

    res = run_on_cluster(["python", str(HERE / "_comm_cluster_child.py")], cluster=emulated_cluster,
                         env={"OMP_NUM_THREADS": "1", "MEMRT_COMM": "hier"}, timeout_s=240)
    lines = [ln for r in res for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 4, [r.stderr[-2000:] for r in res]
    assert all(ln == "RESULT nodes=[[0, 1], [2, 3]] source=discovered ok=True" for ln in lines), lines
