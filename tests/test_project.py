"""``memrt project``: the projection model reduces to the cost model's formulas, behaves as a user expects when
the cluster grows, and the command's JSON, errors and a real run's report folder work end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memrt.cli import main
from memrt.comm import costmodel as cm
from memrt.comm import projection as pj
from memrt.comm.project import report_figures

MiB = 1024 * 1024
SCRIPT = Path(__file__).parent / "scripts" / "step_split_job.py"


def _links(inter_gbit: float = 25.0, local: int = 8) -> cm.LinkModel:
    return cm.LinkModel(intra=pj.link_from_gbit(2400, 2e-6), inter=pj.link_from_gbit(inter_gbit, 10e-6, local))


def _job(**kw) -> pj.JobFigures:
    base = dict(forward_s=0.05, backward_s=0.1, optimizer_s=0.01, bucket_bytes=pj.ddp_buckets(200 * MiB),
                samples_per_rank=8, tokens_per_sample=1024)
    return pj.JobFigures(**{**base, **kw})


def _by_arm(rows):
    return {r.arm: r for r in rows}


def _cluster(nodes: int, local: int = 8, gbit: float = 25.0, **kw) -> pj.Cluster:
    return pj.Cluster(nodes=pj.uniform_nodes([local] * nodes), links=_links(gbit, local), **kw)


def test_comm_is_the_cost_model_sum_and_stock_on_one_node_has_no_inter_term():
    job, cl = _job(), _cluster(4)
    got = _by_arm(pj.project(job, cl, ["stock", "memrt", "int8"]))
    flat = [cm.predict("flat", b, cl.nodes, cl.links) for b in job.bucket_bytes]
    assert got["stock"].comm_s == pytest.approx(sum(flat))
    best = [min(cm.predict(a, b, cl.nodes, cl.links) for a in ("flat", "hier")) for b in job.bucket_bytes]
    assert got["memrt"].comm_s == pytest.approx(sum(best))
    assert got["int8"].comm_s == pytest.approx(sum(cm.predict("hier", b, cl.nodes, cl.links, codec="int8")
                                                   for b in job.bucket_bytes))
    one = _by_arm(pj.project(job, _cluster(1), ["stock"]))["stock"]
    slower_inter = _by_arm(pj.project(job, _cluster(1, gbit=0.1), ["stock"]))["stock"]
    assert one.inter_bytes_per_node == 0 and one.step_s == slower_inter.step_s  # the inter link plays no part
    p = 8
    ring = sum(pj.cm.ring_all_reduce(p, b, cl.links.intra, 0.0) for b in job.bucket_bytes)
    assert one.comm_s == pytest.approx(ring)


def test_more_nodes_on_a_slow_link_grow_memrt_speedup():
    job = _job()
    speedups = [_by_arm(pj.project(job, _cluster(n), ["stock", "memrt"]))["memrt"].speedup_vs_stock
                for n in (8, 64, 512)]
    assert speedups[0] > 1.0 and speedups[0] < speedups[1] < speedups[2], speedups
    fast = _by_arm(pj.project(job, _cluster(64, gbit=400), ["stock", "memrt"]))["memrt"].speedup_vs_stock
    assert fast < speedups[2]  # a faster link leaves stock less to lose


def test_int8_moves_a_quarter_of_the_exact_bytes_across_nodes():
    rows = _by_arm(pj.project(_job(), _cluster(8), ["memrt", "bf16", "int8"]))
    exact = rows["memrt"].inter_bytes_per_node
    assert exact > 0
    assert rows["int8"].inter_bytes_per_node == pytest.approx(exact / 4, rel=1e-3)
    assert rows["bf16"].inter_bytes_per_node == pytest.approx(exact / 2, rel=1e-3)
    assert rows["int8"].step_s < rows["bf16"].step_s < rows["memrt"].step_s


def test_diloco_every_step_is_memrt_exact_plus_the_outer_step():
    job, cl = _job(), _cluster(8)
    rows = _by_arm(pj.project(job, cl, ["memrt", "diloco"], sync_every=1))
    outer = min(cm.predict(a, job.grad_bytes, cl.nodes, cl.links) for a in ("flat", "hier"))
    assert rows["memrt"].step_s <= rows["diloco"].step_s <= rows["memrt"].step_s + outer * 1.01
    # the outer all-reduce of every parameter is blocking; the inner (intra-node) one hides like memrt's buckets
    no_exposed = rows["memrt"].step_s - rows["memrt"].comm_exposed_s
    assert rows["diloco"].step_s == pytest.approx(no_exposed + outer, rel=0.02)
    h100 = _by_arm(pj.project(job, cl, ["memrt", "diloco"], sync_every=100))
    assert h100["diloco"].step_s < h100["memrt"].step_s
    assert h100["diloco"].inter_bytes_per_node == pytest.approx(rows["diloco"].inter_bytes_per_node / 100, rel=1e-6)


def test_exposed_comm_rule():
    # comm well inside the backward: only the last bucket's tail is exposed
    assert pj.exposed_after(1.0, [1, 1, 1, 1], [0.1] * 4) == pytest.approx(0.1)
    # comm longer than the backward: the excess plus what waits for the first bucket
    assert pj.exposed_after(1.0, [1, 1], [2.0, 2.0]) == pytest.approx(0.5 + 4.0 - 1.0)
    measured = 1.0 + pj.exposed_after(1.0, [1, 1, 2], [0.3, 0.3, 0.6])
    assert pj.backward_compute(measured, [1, 1, 2], [0.3, 0.3, 0.6]) == pytest.approx(1.0, rel=1e-6)


def test_uneven_nodes_and_rank_speeds():
    job = _job()
    uneven = pj.Cluster(nodes=pj.uniform_nodes([4, 4, 2]), links=_links(25, 4))
    rows = _by_arm(pj.project(job, uneven))
    assert rows["stock"].ranks == 10 and rows["stock"].nodes == 3
    assert all(r.step_s > 0 for r in rows.values())
    # one rank at half speed: stock waits for it (2x compute); the balancer's step is set by total throughput
    speeds = (1.0,) * 15 + (0.5,)
    slow = _by_arm(pj.project(job, _cluster(2, speeds=speeds), ["stock", "memrt"]))
    compute = job.forward_s + job.backward_s + job.optimizer_s
    assert slow["stock"].compute_s == pytest.approx(2 * compute)
    assert slow["memrt"].compute_s == pytest.approx(compute * 16 / 15.5)


def test_target_links_rescale_the_measured_node_link():
    measured = cm.LinkModel(intra=cm.TierLink(alpha_s=1e-5, beta_s_per_byte=1e-9),
                            inter=cm.TierLink(alpha_s=1e-4, beta_s_per_byte=8e-9, shared_beta_s_per_byte=16e-9),
                            efficiency={"hier": 1.5})
    got = pj.target_links(measured, local_ranks=8, measured_local=2)
    assert got.inter.shared_beta_s_per_byte == pytest.approx(64e-9) and got.efficiency == {"hier": 1.5}
    given = pj.target_links(measured, local_ranks=8, measured_local=2, inter_gbit=100)
    assert given.inter.beta_s_per_byte == pytest.approx(8 / 100e9) and given.efficiency == {}
    with pytest.raises(ValueError, match="--intra-gbit"):
        pj.target_links(None, local_ranks=8)


def _cli(capsys, *argv):
    code = main(["project", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


FIGURES = ["--forward-s", "0.05", "--backward-s", "0.1", "--grad-bytes", str(100 * MiB), "--intra-gbit", "2400",
           "--samples-per-rank", "8", "--tokens-per-sample", "1024"]


def test_cli_json_schema(capsys, tmp_path):
    code, out, err = _cli(capsys, "--nodes", "1,8", "--ranks-per-node", "8", "--inter-gbit", "25,400", "--json",
                          "--plot", str(tmp_path / "p.png"), *FIGURES)
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 2 * 2 * len(pj.ARMS)
    for r in rows:
        assert {"arm", "step_s", "samples_per_s", "tokens_per_s", "comm_exposed_s", "speedup_vs_stock", "nodes",
                "ranks", "inter_gbit"} <= set(r)
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 1024)
    assert {r["arm"] for r in rows} == set(pj.ARMS)
    assert (tmp_path / "p.png").stat().st_size > 1000
    code, out, _ = _cli(capsys, "--ranks-per-node", "4,4,2", "--inter-gbit", "25", "--rank-speeds", "1,0.5", *FIGURES)
    assert code == 0 and "vs stock" in out.splitlines()[0] and len(out.splitlines()) == 1 + len(pj.ARMS)


@pytest.mark.parametrize("argv, option", [
    (["--nodes", "0", "--inter-gbit", "25"], "--nodes"),
    (["--nodes", "two", "--inter-gbit", "25"], "--nodes"),
    (["--nodes", "4", "--inter-gbit", "25", "--arms", "stock,zip"], "--arms"),
    (["--nodes", "4"], "--inter-gbit"),
    (["--nodes", "4", "--inter-gbit", "25", "--sync-every", "0"], "--sync-every"),
    (["--nodes", "4", "--ranks-per-node", "4,4", "--inter-gbit", "25"], "--nodes"),
    (["--inter-gbit", "25"], "--nodes"),
])
def test_cli_bad_input_exits_2_naming_the_option(capsys, argv, option):
    code, out, err = _cli(capsys, *argv, *FIGURES)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and option in err and "Traceback" not in err, err


def test_cli_report_folder_errors(capsys, tmp_path):
    code, _, err = _cli(capsys, str(tmp_path / "missing"), "--nodes", "4", "--inter-gbit", "25")
    assert code == 2 and "REPORT_DIR" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "rank0.json").write_text(json.dumps({"schema": 1, "rank": 0, "memory": [], "comm": [], "trace": []}))
    code, _, err = _cli(capsys, str(tmp_path), "--nodes", "4", "--inter-gbit", "25", "--intra-gbit", "100")
    assert code == 2 and "--forward-s" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_project_a_real_two_rank_run(tmp_path, capsys):
    """A 2-rank MEMRT=1 DDP job (one rank per emulated node) writes its report; the projection reads its step split
    and buckets, reproduces its measured step within 25% when projected to its own shape, and projects it."""
    from memrt.testing import venv_bin

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRT")
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MEMRT="1", MEMRT_REPORT_DIR=str(tmp_path / "report"),
               XDG_CACHE_HOME=str(tmp_path / "c"), MEMRT_TOPOLOGY="0;1")
    argv = [venv_bin("torchrun") or sys.executable, "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--steps", "12", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = report_figures(tmp_path / "report")
    assert found["bucket_bytes"] and sum(found["bucket_bytes"]) == 4 * (64 * 256 + 256 + 256 * 8 + 8)
    assert found.get("samples_per_rank") in (None, 8)  # the balancer's shares, once it has checked the speeds
    assert 0 <= found["backward_s"] <= found["measured_step_s"]
    code, out, err = _cli(capsys, str(tmp_path / "report"), "--nodes", "2", "--ranks-per-node", "1", "--inter-gbit",
                          "10", "--intra-gbit", "10", "--arms", "stock", "--json")
    assert code == 0, err
    own = json.loads(out)[0]
    assert own["step_s"] == pytest.approx(found["measured_step_s"], rel=0.25)
    code, out, err = _cli(capsys, str(tmp_path / "report"), "--nodes", "8,64", "--ranks-per-node", "8",
                          "--inter-gbit", "25", "--intra-gbit", "2400", "--samples-per-rank", "8", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 2 * len(pj.ARMS) and all(r["samples_per_s"] > 0 for r in rows)


def test_report_figures_use_the_measured_links_and_buckets(tmp_path, capsys):
    """A report whose ranks carry the step split, the probe's links and two buckets per step projects with no
    figure on the command line; the measured backward loses the waits the overlap rule puts in it."""
    links = _links(1.0, 2)
    step = {"data": 0.001, "forward": 0.01, "backward": 0.05, "optimizer": 0.002, "other": 0.003, "step": 0.066,
            "steps": 4, "steps_averaged": 2}
    comm = [{"op": "all_reduce", "dtype": "float32", "nbytes": n, "seconds": 0.01, "group_size": 4,
             "start": float(i), "tier_bytes": None} for i, n in enumerate([1 * MiB, 3 * MiB] * 4)]
    for rank in range(4):
        meta = {"activation": {"world_size": 4, "nodes": [[0, 1], [2, 3]], "step": step,
                               "links": json.loads(links.to_json()), "models": [{"parameters": MiB}],
                               "balance": {"shares": [8, 8, 8, 8]},
                               "config": {"MEMRT_SYNC_EVERY": {"value": 20, "source": "environment"}}}}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(
            {"schema": 1, "rank": rank, "meta": meta, "memory": [], "comm": comm, "trace": []}))
    found = report_figures(tmp_path)
    assert found["bucket_bytes"] == (1 * MiB, 3 * MiB) and found["sync_every"] == 20
    assert found["samples_per_rank"] == 8 and found["param_bytes"] == 4 * MiB and found["measured_local"] == 2
    assert found["backward_s"] == pytest.approx(0.05 - pj.exposed_after(found["backward_s"], [1, 3], [0.01, 0.01]))
    assert found["links"].inter.beta_s_per_byte == pytest.approx(links.inter.beta_s_per_byte)
    code, out, err = _cli(capsys, str(tmp_path), "--nodes", "2", "--ranks-per-node", "2", "--json")
    assert code == 0, err
    rows = _by_arm([pj.ArmProjection(**{k: v for k, v in r.items() if k in pj.ArmProjection.__slots__})
                    for r in json.loads(out)])
    assert rows["stock"].inter_bytes_per_node > 0 and rows["diloco"].comm_s > 0
    assert json.loads(out)[0]["inter_gbit"] == pytest.approx(1.0)
