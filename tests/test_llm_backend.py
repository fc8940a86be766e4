"""memrt's process group (memrt.comm.backend) carries every collective of a job through memrt.comm.

Four gloo ranks on one machine with MEMRT_TOPOLOGY faking two nodes of two:
- plain torch.distributed calls, functional collectives (what compiled graphs run) and a 2 x 2
  DeviceMesh's groups: equal to gloo's (bitwise where the algorithm sums in gloo's order, else bitwise
  equal to memrt's documented order ``(r0 + r1) + (r2 + r3)``), inf / NaN kept, the comm log by tier;
- DDP with no comm hook under MEMRT=1 (the activation swaps gloo for the memrt group): parameters after
  3 AdamW steps bitwise equal to stock DDP with exact (flat) collectives, all-reduces in the comm log
  by tier, and under MEMRT_COMM=hier bitwise equal to stock DDP with memrt.comm's DDP hook;
- FSDP2 (fully_shard per block): its all_gather and reduce_scatter in the comm log by tier, gathered
  state after 3 AdamW steps bitwise equal to FSDP2 on gloo (2 and 4 ranks, exact collectives), and
  with torch.compile on top (2 ranks); under MEMRT_COMM=hier bitwise equal to FSDP2 with memrt.comm's
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` comms (the same algorithm, reached without the group).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import _llm_workers as W
from memrt.testing import run_processes

pytestmark = pytest.mark.slow

TWO_NODES = {"MEMRT_TOPOLOGY": "0,1;2,3"}


def _run(fn, world, *args, **env):
    return run_processes(fn, world, *args, env={**TWO_NODES, **env}, init_process_group=False, timeout=280)


def _t(b: bytes, dtype=np.float32) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype=dtype).copy())


def _inputs(world: int) -> list[torch.Tensor]:
    """The tensors plain_collectives reduces (same generator, same fills)."""
    xs = []
    for rank in range(world):
        x = torch.randn(300_000, generator=torch.Generator().manual_seed(100 + rank))
        x[7] = float("inf") if rank == 0 else 1.0
        x[8] = float("nan") if rank == world - 1 else 2.0
        xs.append(x)
    return xs


def _by_op(log: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in log:
        out[(r["op"], r["algorithm"])].append(r)
    return out


def test_plain_calls_functional_collectives_and_mesh_groups():
    memrt = _run(W.plain_collectives, 4, "memrt", MEMRT_COMM="hier")
    gloo = _run(W.plain_collectives, 4, "gloo")
    xs = _inputs(4)
    ordered = (xs[0] + xs[1]) + (xs[2] + xs[3])  # memrt's hierarchical order over nodes [0,1] and [2,3]
    for rank in range(4):
        m, g = memrt[rank], gloo[rank]
        for key in ("all_reduce_RedOpType.MAX", "all_reduce_int", "all_gather", "broadcast", "fc_all_gather",
                    "mesh_across", "mesh_inside"):
            assert m[key] == g[key], f"rank {rank}: {key} differs from gloo's"
        for key in ("all_reduce_RedOpType.SUM", "fc_all_reduce"):
            assert m[key] == ordered.numpy().tobytes(), f"rank {rank}: {key} is not (r0+r1)+(r2+r3)"
        assert m["all_reduce_RedOpType.AVG"] == (ordered / 4).numpy().tobytes()
        rs = ((xs[0][:300_000] + xs[1][:300_000]) + (xs[2][:300_000] + xs[3][:300_000]))[rank * 75_000:(rank + 1) * 75_000]
        assert m["reduce_scatter"] == rs.numpy().tobytes() == m["fc_reduce_scatter"]
        s = _t(m["all_reduce_RedOpType.SUM"])
        assert torch.isinf(s[7]) and torch.isnan(s[8]) and torch.isfinite(s[9:]).all()
        torch.testing.assert_close(s, _t(g["all_reduce_RedOpType.SUM"]), equal_nan=True)
        ops = _by_op(m["log"])
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            recs = ops[(op, "hier")]
            assert recs and all(r["tier_bytes"]["intra"] > 0 and r["tier_bytes"]["inter"] > 0 for r in recs), (op, ops)
        # sub-groups of the 2 x 2 mesh: flat, and on the tier their ranks span
        sub = [r for r in m["log"] if r["group_size"] == 2]
        assert len(sub) == 2
        assert {tier for r in sub for tier, b in r["tier_bytes"].items() if b} == {"intra", "inter"}
    assert not gloo[0]["log"], "stock gloo must not log through memrt"


def test_ddp_without_hook_under_memrt_1(tmp_path):
    stock = _run(W.ddp_train, 4, "gloo", False)
    flat = _run(W.ddp_train, 4, "gloo", True, MEMRT="1", MEMRT_BALANCE="off", MEMRT_COMM="flat", MEMRT_REPORT_DIR=str(tmp_path / "a"))
    hier = _run(W.ddp_train, 4, "gloo", True, MEMRT="1", MEMRT_BALANCE="off", MEMRT_COMM="hier", MEMRT_REPORT_DIR=str(tmp_path / "b"))
    hooked = _run(W.ddp_train, 4, "gloo", False, 3, True, MEMRT_COMM="hier")  # memrt.comm's DDP hook on gloo
    for rank in range(4):
        assert flat[rank]["pg"] == hier[rank]["pg"] == "MemrtProcessGroup" and stock[rank]["pg"] != "MemrtProcessGroup"
        assert not flat[rank]["hook"] and not hier[rank]["hook"], "DDP must hold no comm hook"
        assert flat[rank]["params"] == stock[rank]["params"], f"rank {rank}: parameters differ from stock DDP"
        assert hooked[rank]["hook"] == ["ddp_comm_hook"]
        # hierarchical sums in memrt's order: the same bits as memrt.comm's DDP hook
        assert hier[rank]["params"] == hooked[rank]["params"] == hier[0]["params"], f"rank {rank}"
    # 3 steps -> 3 gradient all-reduces (one bucket), recorded by tier; the ring's node-crossing ranks send inter
    for rank, run in enumerate(flat):
        recs = _by_op(run["log"])[("all_reduce", "flat")]
        assert len(recs) == 3, run["log"]
        tier = "inter" if rank in (1, 3) else "intra"
        assert all(r["tier_bytes"][tier] > 0 for r in recs)
    for run in hier:
        recs = _by_op(run["log"])[("all_reduce", "hier")]
        assert len(recs) == 3 and all(r["tier_bytes"]["intra"] > 0 and r["tier_bytes"]["inter"] > 0 for r in recs)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_collectives_through_memrt(world, tmp_path):
    stock = _run(W.fsdp_train, world, "gloo", False)
    exact = _run(W.fsdp_train, world, "gloo", True, MEMRT="1", MEMRT_COMM="flat", MEMRT_REPORT_DIR=str(tmp_path / "a"),
                 MEMRT_TOPOLOGY="0,1;2,3" if world == 4 else "0;1")
    for rank in range(world):
        assert exact[rank]["pg"] == "MemrtProcessGroup"
        assert exact[rank]["state"] == stock[rank]["state"], f"rank {rank}: gathered state differs from FSDP2"
        ops = _by_op(exact[rank]["log"])
        # 2 blocks resharded after forward (gathered in forward and backward) + the root: 5 all-gathers a step
        assert len(ops[("all_gather", "flat")]) == 15 and len(ops[("reduce_scatter", "flat")]) == 9, ops.keys()
    if world == 4:
        hier = _run(W.fsdp_train, 4, "gloo", True, MEMRT="1", MEMRT_BALANCE="off", MEMRT_COMM="hier", MEMRT_REPORT_DIR=str(tmp_path / "b"))
        custom = _run(W.fsdp_train, 4, "gloo", False, 3, False, True, MEMRT_COMM="hier")
        for rank in range(4):
            ops = _by_op(hier[rank]["log"])
            for op in ("all_gather", "reduce_scatter"):
                recs = ops[(op, "hier")]
                assert len(recs) == (15 if op == "all_gather" else 9)
                assert all(r["tier_bytes"]["intra"] > 0 and r["tier_bytes"]["inter"] > 0 for r in recs)
            # hierarchical sums in memrt's order: the same bits as FSDP2 with memrt.comm's custom comms on gloo
            assert hier[rank]["state"] == custom[rank]["state"], f"rank {rank}"
            assert _by_op(custom[rank]["log"])[("reduce_scatter", "hier")], "custom comms must log too"


def test_fsdp2_gradients_compressed_on_the_slow_tier(tmp_path):
    """MEMRT_COMPRESS under MEMRT=1: FSDP2's gradient reduce-scatter crosses the fake nodes in bf16 / int8
    (hier+<codec> in the comm log, fewer inter-tier bytes), the all-gathers stay exact, the loss follows stock."""
    steps = 24
    stock = _run(W.fsdp_train, 4, "gloo", False, steps)
    for codec, ratio in (("bf16", 0.5), ("int8", 0.26)):
        run = _run(W.fsdp_train, 4, "gloo", True, steps, MEMRT="1", MEMRT_COMPRESS=codec, MEMRT_BALANCE="off",
                   MEMRT_REPORT_DIR=str(tmp_path / codec))
        for rank in range(4):
            ops = _by_op(run[rank]["log"])
            recs = ops[("reduce_scatter", f"hier+{codec}")]
            assert len(recs) == 3 * steps, {k: len(v) for k, v in ops.items()}
            assert all(0 < r["tier_bytes"]["inter"] <= ratio * r["nbytes"] / 4 + 64 for r in recs), recs[0]
            assert not any(a.startswith("hier+") for (o, a) in ops if o != "reduce_scatter")  # all-gathers exact
            assert run[rank]["losses"][0] == stock[rank]["losses"][0]  # no compressed gradient applied yet
        # the loss over every rank and the last pass over the 4 batches: within 1% of stock's, and falling
        first, last, ref = (sum(sum(r["losses"][s]) for r in rs) / 16 for rs, s in
                            ((stock, slice(0, 4)), (run, slice(-4, None)), (stock, slice(-4, None))))
        assert abs(last - ref) <= 0.01 * ref, (codec, last, ref)
        assert last < 0.95 * first, (codec, first, last)


def test_fsdp2_compiled_whole_under_a_budget_recomputes_every_unit():
    """An FSDP2 model compiled as a whole cannot be profiled unit by unit (its units run inside the graph; a
    profile beside the step would run FSDP2's collectives): every unit recomputed inside the graph, the compiled
    step measured under the budget, state bitwise equal to compiled FSDP2 without memrt."""
    budget = 1_400_000
    stock = run_processes(W.fsdp_train, 2, "gloo", False, 4, True, init_process_group=False, timeout=280)
    mine = run_processes(W.fsdp_train, 2, "gloo", False, 4, True, False, budget, init_process_group=False,
                         timeout=280)
    for rank in range(2):
        assert mine[rank]["state"] == stock[rank]["state"], rank
        plan = mine[rank]["plan"]
        assert plan["actions"] == {"blocks.0": "recompute", "blocks.1": "recompute"}, plan
        assert plan["measured"] is not None and plan["measured"] <= budget, plan


def test_fsdp2_compiled_through_memrt(tmp_path):
    stock = run_processes(W.fsdp_train, 2, "gloo", False, 3, True, init_process_group=False, timeout=280)
    memrt = run_processes(W.fsdp_train, 2, "gloo", True, 3, True, env={"MEMRT": "1", "MEMRT_COMM": "flat", "MEMRT_REPORT_DIR": str(tmp_path)},
                          init_process_group=False, timeout=280)
    for rank in range(2):
        assert memrt[rank]["pg"] == "MemrtProcessGroup"
        assert memrt[rank]["state"] == stock[rank]["state"]
        ops = _by_op(memrt[rank]["log"])
        assert ops[("all_gather", "flat")] and ops[("reduce_scatter", "flat")]
