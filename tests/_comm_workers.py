"""Module-level worker functions of the multi-process comm tests (spawned processes import them)."""

from __future__ import annotations

import torch

from _comm_cases import make_input, reference


def other_collectives(rank: int, world: int) -> list[str]:
    """broadcast / all_gather / all_gather_into_tensor / reduce_scatter_tensor vs torch.distributed."""
    import torch.distributed as tdist

    import memrt.comm as dist

    dist.setup_topology()
    topo = dist.get_topology()
    fails: list[str] = []
    for numel, dtype in ((1, torch.float32), (7, torch.int64), (30011, torch.bfloat16)):
        for src in (0, 3):
            x = make_input(rank, numel, dtype, "SUM")
            a, b = x.clone(), x.clone()
            dist.broadcast(a, src=src)
            tdist.broadcast(b, src=src)
            if not torch.equal(a, b):
                fails.append(f"broadcast {numel} {dtype} src={src}")
        x = make_input(rank, numel, dtype, "SUM")
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        flat = torch.empty(world * numel, dtype=dtype)
        dist.all_gather_into_tensor(flat, x)
        want = torch.cat([make_input(r, numel, dtype, "SUM") for r in range(world)])
        if not torch.equal(torch.cat(outs), want) or not torch.equal(flat, want):
            fails.append(f"all_gather {numel} {dtype}")
        for op in ("SUM", "MAX", "AVG") if dtype.is_floating_point else ("SUM", "MIN"):
            big = make_input(rank, numel * world, dtype, op)
            out = torch.empty(numel, dtype=dtype)
            w = dist.reduce_scatter_tensor(out, big, op=getattr(dist.ReduceOp, op), async_op=True)
            w.wait()
            ref = reference([make_input(r, numel * world, dtype, op) for r in range(world)], topo.nodes, op)
            mine_ref = ref[rank * numel:(rank + 1) * numel]
            theirs = torch.empty(numel, dtype=dtype)
            tdist.reduce_scatter_tensor(theirs, big.clone(), op=getattr(tdist.ReduceOp, op))
            if not torch.equal(out, mine_ref):
                fails.append(f"reduce_scatter {numel} {dtype} {op} vs reference")
            if not torch.allclose(out.float(), theirs.float(), rtol=0.1, atol=0.1):
                fails.append(f"reduce_scatter {numel} {dtype} {op} vs torch")
    # the hierarchical all-gather's pipeline: several chunks, the last one short (direct call, small chunks),
    # and a block of more than one default chunk through the public call
    if topo.is_uniform:
        from memrt.comm import hierarchical as alg
        from memrt.comm.setup import STATE

        for numel, chunk_bytes in ((30011, 4000), (3, 4), (0, 64)):
            x = make_input(rank, numel, torch.float32, "SUM")
            out = torch.full((world * numel,), float("nan"))
            alg.hierarchical_all_gather(out, x, topo, groups=STATE.groups, chunk_bytes=chunk_bytes)
            want = torch.cat([make_input(r, numel, torch.float32, "SUM") for r in range(world)])
            if not torch.equal(out, want):
                fails.append(f"hierarchical all_gather {numel} elements in chunks of {chunk_bytes} B")
        for numel, chunk_bytes in ((30011, 4000), (3, 4), (0, 64)):  # reduce-scatter's pipeline, same order
            for op in ("SUM", "AVG", "MAX"):
                big = make_input(rank, numel * world, torch.float32, op)
                out = torch.full((numel,), float("nan"))
                alg.hierarchical_reduce_scatter(out, big, op, topo, groups=STATE.groups, chunk_bytes=chunk_bytes)
                ref = reference([make_input(r, numel * world, torch.float32, op) for r in range(world)], topo.nodes,
                                op)
                if not torch.equal(out, ref[rank * numel:(rank + 1) * numel]):
                    fails.append(f"hierarchical reduce_scatter {numel} {op} in chunks of {chunk_bytes} B")
        numel = (alg.DEFAULT_CHUNK_BYTES // 4) + 1001
        x = make_input(rank, numel, torch.float32, "SUM")
        out = torch.empty(world * numel)
        dist.all_gather_into_tensor(out, x)
        if not torch.equal(out, torch.cat([make_input(r, numel, torch.float32, "SUM") for r in range(world)])):
            fails.append(f"all_gather_into_tensor {numel} float32 (two pipeline chunks)")

    from memrt.profiling.recorder import get_recorder

    algos = {(r.op, r.algorithm) for r in get_recorder().comm}
    for need in (("broadcast", "hier"), ("all_gather", "hier"), ("reduce_scatter", "hier")):
        if topo.is_uniform and need not in algos:
            fails.append(f"no CommRecord for {need}: {sorted(algos)}")
    fails += _profiler_events(dist, world)
    return fails


def _profiler_events(dist, world: int) -> list[str]:
    """Under torch.profiler each memrt call shows as one async event named as gloo names its own, with the
    user's input shape, and none of memrt's internal sub-collectives shows (whatever algorithm ran)."""
    fails: list[str] = []
    x = torch.ones(3, 5)
    calls = {"gloo:all_reduce": (lambda: dist.all_reduce(x.clone()), [[3, 5]]),
             "gloo:broadcast": (lambda: dist.broadcast(x.clone(), src=1), [[3, 5]]),
             "gloo:all_gather": (lambda: dist.all_gather_into_tensor(torch.empty(world * 3, 5), x), [[3, 5]]),
             # gloo records reduce_scatter_tensor as an all-reduce of its input
             "gloo:reduce_scatter": (lambda: dist.reduce_scatter_tensor(torch.empty(3, 5), torch.ones(world * 3, 5)),
                                     [[world * 3, 5]])}
    for name, (call, shapes) in calls.items():
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            call()
        events = [e for e in prof.function_events if e.name.startswith("gloo:")]
        want = "gloo:all_reduce" if name == "gloo:reduce_scatter" else name
        got = [(e.name, e.input_shapes, e.is_async) for e in events]
        if got != [(want, shapes, True)]:
            fails.append(f"profiler events of {name}: {got}, expected [({want!r}, {shapes}, True)]")
    return fails


def _exact_model(seed: int) -> torch.nn.Module:
    # parameters on a 1/8 grid in [-0.5, 0.5]: every gradient sum below is exact in float32
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-4, 5, p.shape).float() / 8)
    return m


def ddp_bitwise(rank: int, world: int, steps: int = 2) -> list[str]:
    """DDP + memrt hook vs plain DDP: parameters bitwise equal after ``steps`` SGD steps."""
    import memrt.comm as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.setup_topology()
    fails: list[str] = []
    results = []
    for use_hook in (False, True):
        model = DDP(_exact_model(0), bucket_cap_mb=0.0002)  # several buckets
        if use_hook:
            dist.register_ddp_hook(model, compress="none")
        opt = torch.optim.SGD(model.parameters(), lr=1 / 16)
        g = torch.Generator().manual_seed(100 + rank)
        grads = []
        for _ in range(steps):
            x = torch.randint(-2, 3, (4, 8), generator=g).float()
            t = torch.randint(-1, 2, (4, 4), generator=g).float()
            opt.zero_grad()
            (model(x) * t).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        results.append(([p.detach().clone() for p in model.parameters()], grads))
    (p0, g0), (p1, g1) = results
    if not all(torch.equal(a, b) for a, b in zip(p0, p1)):
        fails.append("parameters differ between DDP and DDP + memrt hook")
    if not all(torch.equal(a, b) for s0, s1 in zip(g0, g1) for a, b in zip(s0, s1)):
        fails.append("gradients differ between DDP and DDP + memrt hook")
    if all(torch.equal(a, b) for a, b in zip(p0, _exact_model(0).parameters())):
        fails.append("the model did not train")
    from memrt.profiling.recorder import get_recorder

    if not any(r.op == "all_reduce" and r.algorithm.startswith("hier") for r in get_recorder().comm):
        fails.append("the hook did not run memrt's hierarchical all-reduce")
    return fails


def mismatch(rank: int, world: int) -> str:
    """Rank 3 passes a different shape: every rank must get CollectiveMismatchError naming it."""
    import memrt.comm as dist

    dist.setup_topology()
    dist.set_checks(True)
    t = torch.zeros(5 if rank == 3 else 4)
    try:
        dist.all_reduce(t)
    except dist.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def everything_else(rank: int, world: int) -> dict[str, list[str] | str]:
    """One process group for: other collectives, DDP bitwise, the mismatch check (in that order)."""
    return {"collectives": other_collectives(rank, world), "ddp": ddp_bitwise(rank, world),
            "mismatch": mismatch(rank, world)}


def measured_picks(rank: int, world: int) -> dict:
    """all_gather and broadcast with every size a tie for the cost model: the first call of each size class
    times both algorithms, every result (the first call's included) equals torch.distributed's, and each size
    class keeps one algorithm, the same on every rank."""
    import torch.distributed as tdist

    import memrt.comm as dist
    from memrt.comm import measured_pick
    from memrt.comm.setup import STATE
    from memrt.profiling.recorder import get_recorder

    measured_pick.TIE_RATIO = float("inf")  # every prediction pair is a tie
    dist.setup_topology()
    fails: list[str] = []
    sequences: dict[str, list[str]] = {}
    calls = 5
    for numel in (3, 30011):
        x = torch.arange(numel, dtype=torch.float32) + 1000 * rank
        want = torch.cat([torch.arange(numel, dtype=torch.float32) + 1000 * r for r in range(world)])
        seen = len(get_recorder().comm)
        for i in range(calls):  # the first call (the trials') asynchronous
            out = torch.full((world * numel,), float("nan"))
            work = dist.all_gather_into_tensor(out, x, async_op=i % 2 == 0)
            if work is not None:
                work.wait()
            if not torch.equal(out, want):
                fails.append(f"all_gather {numel} call {i}")
        sequences[f"all_gather {numel}"] = [r.algorithm for r in get_recorder().comm[seen:]]
        # the list form, at a size class of its own (the tensor form's pick would hold for it)
        y = torch.cat([x, x, x])
        want_list = [torch.cat([torch.arange(numel, dtype=torch.float32) + 1000 * r] * 3) for r in range(world)]
        seen = len(get_recorder().comm)
        for i in range(calls):
            outs = [torch.full_like(y, float("nan")) for _ in range(world)]
            work = dist.all_gather(outs, y, async_op=i == 0)
            if work is not None:
                work.wait()
            if not all(torch.equal(o, w) for o, w in zip(outs, want_list)):
                fails.append(f"all_gather list {3 * numel} call {i}")
        sequences[f"all_gather list {3 * numel}"] = [r.algorithm for r in get_recorder().comm[seen:]]
        seen = len(get_recorder().comm)
        for i in range(calls):
            a = x.clone()
            b = x.clone()
            work = dist.broadcast(a, src=3, async_op=i == 0)
            if work is not None:
                work.wait()
            tdist.broadcast(b, src=3)
            if not torch.equal(a, b):
                fails.append(f"broadcast {numel} call {i}")
        sequences[f"broadcast {numel}"] = [r.algorithm for r in get_recorder().comm[seen:] if r.op == "broadcast"]
    picks = {f"{k[0]} {k[1]} src={k[2]}": v[0] for k, v in STATE.picks.decided().items()}
    reasons = sorted({v[1] for v in STATE.picks.decided().values()})
    return {"fails": fails, "sequences": sequences, "picks": picks, "reasons": reasons, "calls": calls}
