"""MEMRT_SYNC=diloco (memrt.sync): settings, the outer optimizer's maths, and real 4-rank gloo jobs.

The contract (DESIGN.md, "Synchronization mode"): ranks of a node equal at every step, one model on every
rank after each outer step and at the job's end; with every=1, outer lr 1 and momentum 0 the algorithm is
DDP over all ranks (checked against stock DDP); a checkpoint saved mid-round resumes to the same model.
Streaming (MEMRT_SYNC_FRAGMENTS=K > 1): the fragments partition the parameters at staggered offsets, each
exchange is 1/K of the model, started after the step that ends its round and applied after the next one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memrt.comm.topology import Topology
from memrt.config import load_config
from memrt.errors import ConfigError
from memrt.activation.report import format_sync_line
from memrt.sync import DiLoCo, OuterSGD, attach, fragment_offsets, split_parameters
from memrt.testing import run_processes


# ---------------------------------------------------------------- settings
def test_sync_settings_default_and_parse():
    cfg = load_config({})
    assert (cfg.sync, cfg.sync_every, cfg.sync_fragments) == ("exact", 50, 1)
    cfg = load_config({"MEMRT_SYNC": " DiLoCo ", "MEMRT_SYNC_EVERY": "7", "MEMRT_SYNC_FRAGMENTS": "3"})
    assert (cfg.sync, cfg.sync_every, cfg.sync_fragments) == ("diloco", 7, 3)
    assert cfg.sources["MEMRT_SYNC"] == cfg.sources["MEMRT_SYNC_EVERY"] == "environment"
    assert cfg.sources["MEMRT_SYNC_FRAGMENTS"] == "environment"
    assert load_config({}, sync="diloco", sync_every=3).sync_every == 3
    assert {"MEMRT_SYNC", "MEMRT_SYNC_EVERY", "MEMRT_SYNC_FRAGMENTS"} <= set(cfg.agreed())


@pytest.mark.parametrize("var,value", [("MEMRT_SYNC", "local-sgd"), ("MEMRT_SYNC", "1"), ("MEMRT_SYNC_EVERY", "0"),
                                       ("MEMRT_SYNC_EVERY", "-3"), ("MEMRT_SYNC_EVERY", "2.5"),
                                       ("MEMRT_SYNC_EVERY", "ten"), ("MEMRT_SYNC_EVERY", "١٠"),
                                       ("MEMRT_SYNC_FRAGMENTS", "0"), ("MEMRT_SYNC_FRAGMENTS", "1.5"),
                                       ("MEMRT_SYNC_FRAGMENTS", "two")])
def test_sync_settings_bad_values_name_the_variable(var, value):
    with pytest.raises(ConfigError) as info:
        load_config({var: value})
    assert var in str(info.value) and "expected" in str(info.value)


def test_sync_every_bad_argument_names_the_variable():
    for bad in (0, True, "x"):
        with pytest.raises(ConfigError, match="MEMRT_SYNC_EVERY"):
            load_config({}, sync_every=bad)
        with pytest.raises(ConfigError, match="MEMRT_SYNC_FRAGMENTS"):
            load_config({}, sync_fragments=bad)


# ---------------------------------------------------------------- the outer optimizer, one process
def test_outer_sgd_is_torch_nesterov_sgd():
    """OuterSGD on (anchor, delta) is torch.optim.SGD(nesterov=True) with the delta as the gradient."""
    gen = torch.Generator().manual_seed(0)
    anchor = torch.randn(10, generator=gen)
    param = torch.nn.Parameter(anchor.clone())
    ref = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    outer, buf = OuterSGD(), torch.zeros(10)
    for _ in range(4):
        delta = torch.randn(10, generator=gen)
        param.grad = delta.clone()
        ref.step()
        outer.step(anchor, buf, delta.clone())
        torch.testing.assert_close(anchor, param.detach(), rtol=0, atol=1e-6)


def test_outer_sgd_checks_its_values():
    with pytest.raises(ValueError, match="outer_momentum"):
        OuterSGD(momentum=1.0)
    with pytest.raises(ValueError, match="outer_lr"):
        OuterSGD(lr=0)


def test_attach_changes_nothing_when_exact_or_single_node():
    model = torch.nn.Linear(3, 2)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_node = Topology.from_nodes([[0, 1, 2, 3]], 0)
    assert attach(model, opt, config=load_config({}), topology=Topology.from_nodes([[0, 1], [2, 3]], 0)) is None
    assert attach(model, opt, config=load_config({}, sync="diloco"), topology=one_node) is None
    assert attach(model, opt, config=load_config({}, sync="diloco")) is None  # no process group
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_diloco_rejects_a_bad_every_before_any_collective():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="every="):
            DiLoCo(model, opt, Topology.from_nodes([[0], [1]], 0), every=bad)


def test_diloco_rejects_bad_fragments_before_any_collective():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))  # 4 parameter tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    topo = Topology.from_nodes([[0], [1]], 0)
    for bad, every in ((0, 4), (True, 4), (2.0, 4), (5, 8), (3, 2)):  # K > tensors (5 > 4), K > every (3 > 2)
        with pytest.raises(ValueError, match="MEMRT_SYNC_FRAGMENTS"):
            DiLoCo(model, opt, topo, every=every, fragments=bad)


def test_fragments_split_in_order_by_elements_at_staggered_offsets():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 10, 10, 80, 5, 95)]  # 300 elements
    groups = split_parameters(params, 3)
    assert [p for g in groups for p in g] == params  # a partition, in order, no tensor split
    assert [sum(p.numel() for p in g) for g in groups] == [100, 100, 100]
    assert [len(g) for g in split_parameters(params, 6)] == [1] * 6
    assert [len(g) for g in split_parameters([params[0]] + [torch.nn.Parameter(torch.zeros(1))] * 3, 4)] == [1] * 4
    assert split_parameters(params, 1) == [tuple(params)]
    with pytest.raises(ValueError):
        split_parameters(params, 7)
    assert fragment_offsets(1, 50) == [0]
    assert fragment_offsets(2, 4) == [0, 2]
    assert fragment_offsets(3, 10) == [0, 3, 7]
    assert fragment_offsets(4, 4) == [0, 1, 2, 3]


def test_the_summary_line_says_when_fragments_are_streamed():
    summary = {"every": 4, "nodes": 2, "inner_steps": 9, "outer_steps": 5, "outer_bytes_per_step": 848,
               "compress": "none", "host_bytes": 1696, "fragments": 1}
    assert "fragments" not in format_sync_line(summary)
    assert "9 inner steps, 5 outer steps, 2 fragments streamed |" in format_sync_line({**summary, "fragments": 2})


# ---------------------------------------------------------------- 4 ranks (gloo), module-level workers
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int, size: int = 6):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 8, generator=gen), torch.randn(size, 4, generator=gen)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _steps(rank, ddp, opt, steps, after=None, size=6):
    for s in steps:
        x, y = _batch(rank, s, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if after is not None:
            after(s)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, t)
    return out


def _diloco(rank, topo, every, opt_kind="adamw", **kw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model())
    opt = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if opt_kind == "adamw"
           else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    return ddp, opt, DiLoCo(ddp, opt, topo, every=every, **kw)


def _round_trip_worker(rank, world):
    """every=3, 7 inner steps + finish: node replicas every step, one model at the end, counters, resume."""
    topo = Topology.from_nodes([[0, 1], [2, 3]], rank)
    mate = {0: 1, 1: 0, 2: 3, 3: 2}[rank]
    ddp, opt, sync = _diloco(rank, topo, 3)
    within, across = [], []

    def check(step):
        flats = _gathered(_flat(ddp.module))
        within.append(torch.equal(flats[rank], flats[mate]))
        across.append(torch.equal(flats[0], flats[2]))

    _steps(rank, ddp, opt, range(7), after=check)
    sync.finish()
    final = _flat(ddp.module)
    flats = _gathered(final)
    summary = sync.summary()

    # the same job saved after inner step 4 (mid-round) and resumed in fresh objects
    ddp2, opt2, sync2 = _diloco(rank, topo, 3)
    _steps(rank, ddp2, opt2, range(4))
    saved = copy.deepcopy((ddp2.module.state_dict(), opt2.state_dict(), sync2.state_dict()))
    ddp3, opt3, sync3 = _diloco(rank, topo, 3)
    ddp3.module.load_state_dict(saved[0])  # after DDP: its construction broadcast rank 0's replica
    opt3.load_state_dict(saved[1])
    sync3.load_state_dict(saved[2])
    _steps(rank, ddp3, opt3, range(4, 7))
    sync3.finish()
    return dict(within=within, across=across, all_equal=all(torch.equal(f, flats[0]) for f in flats),
                summary=summary, numel=final.numel(), resumed_equal=torch.equal(_flat(ddp3.module), final),
                resumed_outer=sync3.outer_steps)


def _from_environment_worker(rank, world):
    """attach() as the activation will call it: settings from the environment, nodes from memrt.comm
    (MEMRT_TOPOLOGY), the outer exchange compressed to bf16 through memrt.comm.all_reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    sync = attach(ddp, opt, compress="bf16")
    _steps(rank, ddp, opt, range(5))
    sync.finish()
    flats = _gathered(_flat(ddp.module))
    return dict(summary=sync.summary(), source=sync.topology.source,
                all_equal=all(torch.equal(f, flats[0]) for f in flats))


def _streaming_worker(rank, world):
    """K=2 fragments, every=4, 9 inner steps + finish: the schedule, overlap, exchange sizes, resume, and K=1."""
    topo = Topology.from_nodes([[0, 1], [2, 3]], rank)
    mate = {0: 1, 1: 0, 2: 3, 3: 2}[rank]
    ddp, opt, sync = _diloco(rank, topo, 4, fragments=2)
    frags = [torch.cat([p.detach().reshape(-1) for p in f.params]) for f in sync.fragments]
    trace = []

    def check(step):
        flats = _gathered(_flat(ddp.module))
        parts = _gathered([torch.cat([p.detach().reshape(-1) for p in f.params]) for f in sync.fragments])
        trace.append(dict(pending=sync.pending_exchanges, outer=sync.outer_steps,
                          within=torch.equal(flats[rank], flats[mate]),
                          across=[torch.equal(parts[0][i], parts[2][i]) for i in range(len(frags))],
                          started=bool(sync._pending) and sync._pending[0].work is not None))

    _steps(rank, ddp, opt, range(9), after=check)
    sync.finish()
    final = _flat(ddp.module)
    flats = _gathered(final)
    out = dict(trace=trace, all_equal=all(torch.equal(f, flats[0]) for f in flats), summary=sync.summary(),
               offsets=[f.offset for f in sync.fragments], sizes=[f.numel for f in sync.fragments],
               partition=[id(p) for f in sync.fragments for p in f.params] == [id(p) for p in ddp.module.parameters()],
               after_finish=(sync.pending_exchanges, sync.outer_steps))

    # the plug point (blocking, recorded): the same maths, one exchange per fragment round of 4 x its elements
    exchanges = []

    def exchange(tensor, group):
        exchanges.append(tensor.numel() * tensor.element_size())
        torch.distributed.all_reduce(tensor, group=group)

    ddp2, opt2, sync2 = _diloco(rank, topo, 4, fragments=2, outer_all_reduce=exchange)
    _steps(rank, ddp2, opt2, range(9))
    sync2.finish()
    out["exchanges"], out["plugged_equal"] = exchanges, torch.equal(_flat(ddp2.module), final)

    # saved right after inner step 2, with fragment 1's exchange pending, and resumed in fresh objects
    ddp3, opt3, sync3 = _diloco(rank, topo, 4, fragments=2)
    _steps(rank, ddp3, opt3, range(2))
    out["pending_at_save"] = sync3.pending_exchanges
    saved = copy.deepcopy((ddp3.module.state_dict(), opt3.state_dict(), sync3.state_dict()))
    ddp4, opt4, sync4 = _diloco(rank, topo, 4, fragments=2)
    ddp4.module.load_state_dict(saved[0])
    opt4.load_state_dict(saved[1])
    sync4.load_state_dict(saved[2])
    _steps(rank, ddp4, opt4, range(2, 9))
    sync4.finish()
    out["resumed_equal"] = torch.equal(_flat(ddp4.module), final)

    # K=1 is today's blocking path: fragments=1 and the default give the same model, bitwise
    one = []
    for kw in ({"fragments": 1}, {}):
        ddp5, opt5, sync5 = _diloco(rank, topo, 4, **kw)
        _steps(rank, ddp5, opt5, range(9))
        sync5.finish()
        one.append(_flat(ddp5.module))
    out["k1_equal"], out["k1_differs_from_k2"] = torch.equal(one[0], one[1]), not torch.equal(one[0], final)
    return out


def _worker(rank, world):
    return {"round_trip": _round_trip_worker(rank, world), "matches_ddp": _matches_ddp_worker(rank, world),
            "from_env": _from_environment_worker(rank, world), "streaming": _streaming_worker(rank, world)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One 4-rank gloo launch for every multi-process check of this file (each launch costs seconds)."""
    env = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_SYNC": "diloco", "MEMRT_SYNC_EVERY": "2",
           "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}  # memrt.comm's measured links go there
    return run_processes(_worker, 4, env=env, timeout=240)


@pytest.mark.slow
def test_attach_from_the_environment_with_a_compressed_exchange(four_ranks):
    for r, res in enumerate(x["from_env"] for x in four_ranks):
        s = res["summary"]
        assert res["source"] == "MEMRT_TOPOLOGY" and s["nodes"] == 2 and s["every"] == 2, (r, res)
        assert (s["inner_steps"], s["outer_steps"], s["compress"]) == (5, 3, "bf16"), (r, s)
        assert res["all_equal"], r  # compressed exchange: every rank decodes the same bytes, one model


@pytest.mark.slow
def test_diloco_replicas_counters_and_resume(four_ranks):
    for r, res in enumerate(x["round_trip"] for x in four_ranks):
        # within a node the ranks are equal at every step; across nodes only right after an outer step
        assert res["within"] == [True] * 7, (r, res["within"])
        assert res["across"] == [False, False, True, False, False, True, False], (r, res["across"])
        assert res["all_equal"], r  # one model on every rank after finish()
        s, n = res["summary"], res["numel"]
        assert (s["inner_steps"], s["outer_steps"]) == (7, 3)  # steps 3 and 6, then finish()
        assert s["outer_bytes_last"] == s["outer_bytes_per_step"] == 4 * n  # float32: 4 bytes x elements
        assert s["outer_bytes_total"] == 3 * 4 * n
        assert s["host_bytes"] == 2 * 4 * n  # anchor + momentum, float32 (CPU: no staging buffer)
        assert res["resumed_equal"], r  # resumed mid-round: the same model as the uninterrupted run
        assert res["resumed_outer"] == 3


def _matches_ddp_worker(rank, world):
    """every=1, outer lr 1, momentum 0 == DDP over all ranks (SGD with momentum inside), even and uneven nodes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = DDP(_model())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _steps(rank, ref, ref_opt, range(5))
    out = {}
    exchanges = []

    def exchange(tensor, group):  # the outer exchange's plug point: here torch's exact all-reduce, counted
        exchanges.append(tensor.numel() * tensor.element_size())
        torch.distributed.all_reduce(tensor, group=group)

    for nodes in ([[0, 1], [2, 3]], [[0, 1, 2], [3]]):
        ddp, opt, _ = _diloco(rank, Topology.from_nodes(nodes, rank), 1, "sgd", outer_lr=1.0, outer_momentum=0.0,
                              outer_all_reduce=exchange)
        _steps(rank, ddp, opt, range(5))
        diff = (_flat(ddp.module) - _flat(ref.module)).abs().max().item()
        moved = (_flat(ddp.module) - _flat(_model())).abs().max().item()
        out[str(nodes)] = (diff, moved)
    out["exchanges"] = exchanges
    out["numel"] = sum(p.numel() for p in ref.parameters())
    # a plain module (no DDP): gradients averaged within the node before each inner step
    plain = _model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    DiLoCo(plain, plain_opt, Topology.from_nodes([[0, 1], [2, 3]], rank), every=1, outer_lr=1.0, outer_momentum=0.0)
    _steps(rank, plain, plain_opt, range(5))
    out["plain"] = (_flat(plain) - _flat(ref.module)).abs().max().item()

    # samples counted per rank weight the nodes: uneven batches on uneven nodes, one round of 2 steps
    nodes = [[0, 1, 2], [3]]
    sizes = {0: 2, 1: 3, 2: 4, 3: 11}
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    anchor = _flat(ddp.module)
    before_outer = {}
    opt.register_step_post_hook(lambda *a: before_outer.__setitem__("p", _flat(ddp.module)))  # runs before sync's
    sync = DiLoCo(ddp, opt, Topology.from_nodes(nodes, rank), every=2, outer_lr=1.0, outer_momentum=0.0)
    for s in range(2):
        sync.count_samples(sizes[rank])
        _steps(rank, ddp, opt, [s], size=sizes[rank])
    replicas = _gathered(before_outer["p"])
    w = [sum(sizes[r] for r in n) for n in nodes]
    expected = anchor - sum(wn * (anchor - replicas[n[0]]) for wn, n in zip(w, nodes)) / sum(w)
    out["weighted"] = (_flat(ddp.module) - expected).abs().max().item()
    out["unweighted_gap"] = (expected - (replicas[0] + replicas[3]) / 2).abs().max().item()
    return out


@pytest.mark.slow
def test_diloco_every_step_is_ddp_and_nodes_weigh_their_samples(four_ranks):
    for r, res in enumerate(x["matches_ddp"] for x in four_ranks):
        for nodes in ("[[0, 1], [2, 3]]", "[[0, 1, 2], [3]]"):
            diff, moved = res[nodes]
            assert moved > 1e-3, (r, nodes)  # training moved the parameters
            assert diff < 1e-6, (r, nodes, diff)  # and DiLoCo(H=1, lr 1, no momentum) moved them as DDP did
        assert res["exchanges"] == [4 * res["numel"]] * 10  # one exchange per outer step: the model in float32
        assert res["plain"] < 1e-6, (r, res["plain"])
        assert res["weighted"] < 1e-6, (r, res["weighted"])
        assert res["unweighted_gap"] > 1e-4, r  # the weights mattered


@pytest.mark.slow
def test_streamed_fragments_overlap_the_next_step_and_end_as_one_model(four_ranks):
    """K=2, every=4: fragment 1 (offset 2) exchanges after steps 2 and 6, fragment 0 (offset 0) after 4 and 8;
    each exchange is still pending right after its step and applied in the next step's post-hook."""
    for r, res in enumerate(x["streaming"] for x in four_ranks):
        assert res["offsets"] == [0, 2] and res["partition"], (r, res["offsets"])
        trace = res["trace"]
        assert [t["pending"] for t in trace] == [0, 1, 0, 1, 0, 1, 0, 1, 0], (r, trace)
        assert all(t["started"] for t in trace if t["pending"]), r  # an async exchange in flight
        assert [t["outer"] for t in trace] == [0, 0, 1, 1, 2, 2, 3, 3, 4], (r, trace)
        assert all(t["within"] for t in trace), r  # the ranks of a node equal at every step
        # a fragment is equal across nodes right after the step whose post-hook applied its exchange
        assert [t["across"] for t in trace] == [[False, False], [False, False], [False, True], [False, False],
                                               [True, False], [False, False], [False, True], [False, False],
                                               [True, False]], (r, trace)
        assert res["after_finish"] == (0, 5) and res["all_equal"], r  # finish(): fragment 1's last round
        sizes, s = res["sizes"], res["summary"]
        assert res["exchanges"] == [4 * sizes[i] for i in (1, 0, 1, 0, 1)], (r, res["exchanges"], sizes)
        assert (s["fragments"], s["peak_outer_bytes"], s["outer_bytes_per_step"]) == (2, 4 * max(sizes), 4 * sum(sizes))
        assert s["outer_bytes_total"] == sum(res["exchanges"])
        assert res["plugged_equal"], r  # a blocking exchange at the plug point: the same model, bitwise
        assert res["pending_at_save"] == 1 and res["resumed_equal"], r  # saved with an exchange pending
        assert res["k1_equal"] and res["k1_differs_from_k2"], r
