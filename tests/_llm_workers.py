"""Rank functions for tests/test_llm_*.py (importable by spawned children)."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def init(rank: int, world: int, backend: str) -> None:
    """init_process_group over the harness's store; ``backend="memrt"`` registers memrt's group first."""
    if backend == "memrt":
        from memrt.comm.backend import register

        register()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def comm_log() -> list[dict[str, Any]]:
    from memrt.profiling.recorder import get_recorder

    return [{"op": r.op, "algorithm": r.algorithm, "nbytes": r.nbytes, "tier_bytes": dict(r.tier_bytes),
             "group_size": r.group_size} for r in get_recorder().comm]


def clear_log() -> None:
    from memrt.profiling.recorder import get_recorder

    get_recorder().comm.clear()


def plain_collectives(rank: int, world: int, backend: str) -> dict[str, Any]:
    """dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor / broadcast, inf and NaN included."""
    init(rank, world, backend)
    g = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {}
    big = torch.randn(300_000, generator=g)
    big[7] = float("inf") if rank == 0 else 1.0
    big[8] = float("nan") if rank == world - 1 else 2.0
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        t = big.clone()
        dist.all_reduce(t, op=op)
        out[f"all_reduce_{op}"] = t
    ints = torch.arange(1000, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(ints)
    out["all_reduce_int"] = ints
    o = torch.empty(world * 50_000)
    dist.all_gather_into_tensor(o, big[:50_000].clone())
    out["all_gather"] = o
    rs = torch.empty(75_000)
    dist.reduce_scatter_tensor(rs, big[:75_000 * world].clone())
    out["reduce_scatter"] = rs
    b = big.clone()
    dist.broadcast(b, src=1)
    out["broadcast"] = b
    w = dist.all_reduce(big.clone(), async_op=True)
    w.wait()
    import torch.distributed._functional_collectives as fc  # what compiled graphs run

    out["fc_all_reduce"] = fc.wait_tensor(fc.all_reduce(big.clone(), "sum", dist.group.WORLD))
    out["fc_all_gather"] = fc.wait_tensor(fc.all_gather_tensor(big[:50_000].clone(), 0, dist.group.WORLD))
    out["fc_reduce_scatter"] = fc.wait_tensor(fc.reduce_scatter_tensor(big[:75_000 * world].clone(), "sum", 0,
                                                                       dist.group.WORLD))
    if world == 4:  # a 2 x 2 DeviceMesh: one dimension inside the (faked) nodes, one across
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("across", "inside"))
        for dim in ("across", "inside"):
            t = big[:1000].clone()
            dist.all_reduce(t, group=mesh.get_group(dim))
            out[f"mesh_{dim}"] = t
    out = {k: v.numpy().tobytes() for k, v in out.items()}  # bytes: equal bits compare equal (NaN too)
    out["log"] = comm_log()
    dist.destroy_process_group()
    return out


def _activate() -> None:
    """What MEMRT=1 does at interpreter start (the children of run_processes get MEMRT=1 after it)."""
    from memrt.activation.hooks import install

    install()


def tiny_gpt(seed: int = 0, n_layer: int = 2):
    from memrt.testing.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=32, dropout=0.0))


def _batch(rank: int, step: int):
    from memrt.testing.models import GPTConfig, gpt_batch

    return gpt_batch(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32), 4,
                     seed=1000 * step + rank)


def ddp_train(rank: int, world: int, backend: str, activate: bool, steps: int = 3,
              memrt_hook: bool = False) -> dict[str, Any]:
    """DDP without a comm hook, AdamW; returns the parameters (bytes), the hooks DDP holds and the comm log."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memrt.testing.models import lm_loss

    if activate:
        _activate()
    init(rank, world, backend)
    model = DDP(tiny_gpt())
    if memrt_hook:  # the established path: memrt.comm's DDP hook over a gloo default group
        import memrt.comm as mc

        mc.setup_topology()
        mc.register_ddp_hook(model, compress="none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clear_log()
    for step in range(steps):
        x, y = _batch(rank, step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {"params": {k: v.detach().numpy().tobytes() for k, v in model.module.state_dict().items()},
           "log": comm_log(), "pg": type(dist.distributed_c10d._get_default_group()).__name__,
           "hook": [getattr(h, "__name__", repr(h)) for h, _ in model._comm_hooks]}
    dist.destroy_process_group()
    return out


def fsdp_train(rank: int, world: int, backend: str, activate: bool, steps: int = 3,
               compile_model: bool = False, custom_comms: bool = False, budget: Any = None,
               n_layer: int = 2) -> dict[str, Any]:
    """fully_shard per block + root, AdamW; the gathered state after ``steps`` and the comm log."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memrt.testing.models import lm_loss

    if activate:
        _activate()
    init(rank, world, backend)
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_gpt(n_layer=n_layer)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if custom_comms:  # FSDP2's set_custom_all_gather / set_custom_reduce_scatter with memrt.comm
        import memrt.comm as mc
        from memrt.comm.fsdp_comms import use_memrt_comms

        mc.setup_topology()
        use_memrt_comms(model)
    if budget is not None:
        import memrt
        from memrt.memory.cache import PlanCache

        memrt.auto(model, budget=budget, offload="none", cache=PlanCache())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = torch.compile(model) if compile_model else model
    clear_log()
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step % 4)  # a few batches again and again: the loss falls
        loss = lm_loss(fwd(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    log = comm_log()
    state = {k: v.full_tensor().detach().numpy().tobytes() for k, v in model.state_dict().items()}
    out = {"state": state, "log": log, "pg": type(dist.distributed_c10d._get_default_group()).__name__,
           "losses": losses}
    if budget is not None:
        import memrt

        plan = memrt.plan_of(model)
        out["plan"] = None if plan is None else {"actions": {u.name: u.action for u in plan.units},
                                                  "measured": plan.measured_peak_bytes, "budget": plan.budget_bytes,
                                                  "predicted": plan.predicted_peak_bytes}
    dist.destroy_process_group()
    return out


def _gpt_adamw_steps(model: Any, forward: Any, cfg: Any, steps: int) -> None:
    """``steps`` AdamW steps of ``model`` through ``forward`` on the seeded GPT batches 0, 1, ..."""
    from memrt.testing.models import gpt_batch, lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = gpt_batch(cfg, 8, seed=s)
        lm_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()


def _untied_gpt(cfg: Any) -> Any:
    """memrt's test GPT with its head's weight untied from the token embedding (see docs: tied + graph break)."""
    from memrt.testing.models import GPT

    m = GPT(cfg)
    m.head.weight = torch.nn.Parameter(m.tok.weight.detach().clone())
    return m


def compile_check(out_path: str, budget: int, dropout: float = 0.0) -> None:
    """Compiled stock vs compiled + memrt (auto then compile, and auto of the compiled model), 4 AdamW steps
    (step 1 profiles, step 2 recompiles under the plan, step 3 is certified when step 4 begins), the GPT's
    dropout ``dropout`` (0: a forward without random numbers, which memrt may leave to torch's partitioner).

    Run in a fresh process with one thread (inductor's CPU reductions split over threads are not
    reproducible run to run) and MALLOC_MMAP_THRESHOLD_=65536 (memrt's CPU budget measure).
    Writes a JSON summary to ``out_path``.
    """
    import json

    import torch._functorch.config as fconfig

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import GPTConfig

    torch.set_num_threads(1)

    cfg = GPTConfig(vocab_size=128, seq_len=128, n_layer=2, n_head=2, d_model=64, dropout=dropout)

    def run(mode: str) -> tuple[dict, Any, Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = _untied_gpt(cfg)
        if mode == "auto_then_compile":
            memrt.auto(m, budget=budget, offload="none", cache=PlanCache())
        f = torch.compile(m)
        if mode == "auto_of_compiled":
            assert memrt.auto(f, budget=budget, offload="none", cache=PlanCache()) is f
        _gpt_adamw_steps(m, f, cfg, 4)
        actions = dict(getattr(getattr(m.blocks[0], "forward", None), "ref", lambda: None)().compiled_actions) \
            if hasattr(m.blocks[0].forward, "ref") else {}
        return {k: v.clone() for k, v in m.state_dict().items()}, memrt.plan_of(m), actions

    ref, _, _ = run("stock")
    summary: dict[str, Any] = {}
    for mode in ("auto_then_compile", "auto_of_compiled"):
        state, plan, actions = run(mode)
        summary[mode] = {"equal": all(torch.equal(state[k], ref[k]) for k in ref),
                         "actions": {u.name: u.action for u in plan.units}, "compiled_actions": actions,
                         "measured": plan.measured_peak_bytes, "budget": plan.budget_bytes,
                         "compiled_budget": plan.compiled_budget,
                         "setting_after": fconfig.activation_memory_budget}
    with open(out_path, "w") as f:
        json.dump(summary, f)


def partitioner_setting_check(out_path: str) -> None:
    """Two small GPTs without dropout compiled under memrt's partitioner plans at two budgets, their steps
    alternating, with dynamo allowed one recompile per frame (so that the second model's forward runs eagerly
    after memrt's step hook patched torch's setting): torch's ``activation_memory_budget`` after every step, and
    the plans' ratios. Fresh process, one thread."""
    import json

    import torch._dynamo.config as dconfig
    import torch._functorch.config as fconfig

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    torch.manual_seed(0)
    probe = GPT(cfg)
    memrt.auto(probe, budget=10**9, offload="none", cache=PlanCache())
    _gpt_adamw_steps(probe, probe, cfg, 2)
    keep_all, low = memrt.plan_of(probe).keep_all_peak_bytes, memrt.plan_of(probe).min_feasible_bytes
    dconfig.recompile_limit = 1
    models = []
    for fraction in (0.8, 0.6):
        m = GPT(cfg)
        memrt.auto(m, budget=int(low + fraction * (keep_all - low)), offload="none", cache=PlanCache())
        models.append((m, torch.compile(m), torch.optim.AdamW(m.parameters(), lr=1e-2)))
    settings, ratios = [], set()
    for s in range(5):
        for m, f, opt in models:
            x, y = gpt_batch(cfg, 8, seed=s)
            lm_loss(f(x), y).backward()
            opt.step()
            opt.zero_grad()
            settings.append(fconfig.activation_memory_budget)
            ratios.add(memrt.plan_of(m).compiled_budget)
    with open(out_path, "w") as f:
        json.dump({"settings": settings, "ratios": sorted(r for r in ratios if r is not None)}, f)


def _compiled_adamw(build: Any, loss: Any, *, steps: int, lr: float, budget: int | None) -> tuple[dict, Any]:
    """State after ``steps`` AdamW steps on ``loss(torch.compile(model))`` of a model ``build()`` makes from seed 0
    (``memrt.auto`` at ``budget`` first, unless None), and memrt's plan for it (None without a budget)."""
    import memrt
    from memrt.memory.cache import PlanCache

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = build()
    if budget is not None:
        memrt.auto(m, budget=budget, offload="none", cache=PlanCache())
    f = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    for _ in range(steps):
        loss(f).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in m.state_dict().items()}, memrt.plan_of(m) if budget is not None else None


def hf_partition_check(out_path: str, fraction: float) -> None:
    """transformers' Llama (SDPA attention, no dropout, untied head) compiled whole: stock vs memrt.auto at the
    budget ``fraction`` of the way from memrt's floor to its keep-all peak (read from an uncompiled probe's plan),
    6 AdamW steps of a causal-LM loss computed by the model. Fresh process, one thread."""
    import json

    import memrt
    from memrt.memory.cache import PlanCache
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    ids = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    probe = LlamaForCausalLM(cfg).train()
    memrt.auto(probe, budget=10**10, offload="none", cache=PlanCache())
    for _ in range(2):
        probe(input_ids=ids, labels=ids).loss.backward()
    low, high = memrt.plan_of(probe).min_feasible_bytes, memrt.plan_of(probe).keep_all_peak_bytes
    memrt.disable(probe)
    del probe
    budget = int(low + fraction * (high - low))

    def loss(f: Any) -> torch.Tensor:
        return f(input_ids=ids, labels=ids).loss

    ref, _ = _compiled_adamw(lambda: LlamaForCausalLM(cfg).train(), loss, steps=6, lr=1e-3, budget=None)
    state, plan = _compiled_adamw(lambda: LlamaForCausalLM(cfg).train(), loss, steps=6, lr=1e-3, budget=budget)
    with open(out_path, "w") as f:
        json.dump({"equal": all(torch.equal(state[k], ref[k]) for k in ref), "budget": budget,
                   "measured": plan.measured_peak_bytes, "compiled_budget": plan.compiled_budget}, f)


def partition_miss_check(out_path: str, budget: int) -> None:
    """A compiled GPT without dropout whose partitioned step misses the budget: memrt tries the partitioner, then
    plans the units' actions; 6 AdamW steps, state against compiled stock, the plan's measured peak, memrt's
    warnings. Fresh process, one thread.

    Whether torch's partitioner meets a ratio depends on the model and on the kernels inductor picks for the CPU at
    hand (a small CNN's second try fits its budget on one machine and misses on another), so the miss is made
    certain: the ratio memrt chooses is never handed to torch, whose partitioner then keeps every activation (its
    default)."""
    import json
    import logging

    import memrt.memory.instrument as instrument
    from memrt.testing.models import GPTConfig, gpt_batch, lm_loss

    torch.set_num_threads(1)
    instrument.patch_partitioner = lambda inst: None
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("memrt").addHandler(Keep(logging.WARNING))
    cfg = GPTConfig(vocab_size=128, seq_len=128, n_layer=2, n_head=2, d_model=64, dropout=0.0)
    x, y = gpt_batch(cfg, 8, seed=0)

    def loss(f: Any) -> torch.Tensor:
        return lm_loss(f(x), y)

    ref, _ = _compiled_adamw(lambda: _untied_gpt(cfg), loss, steps=6, lr=1e-2, budget=None)
    state, plan = _compiled_adamw(lambda: _untied_gpt(cfg), loss, steps=6, lr=1e-2, budget=budget)
    summary = {"equal": all(torch.equal(state[k], ref[k]) for k in ref), "measured": plan.measured_peak_bytes,
               "compiled_budget": plan.compiled_budget, "actions": [u.action for u in plan.units],
               "said": [m for m in said if "partitioned by torch" in m]}
    with open(out_path, "w") as f:
        json.dump(summary, f)


def block_compile_check(out_path: str, budget: int) -> None:
    """torch.compile of each block (torchtitan's way; the model itself stays eager), stock vs memrt.auto without
    a budget (its steps measured) and at ``budget`` (profiled, planned, certified), 5 AdamW steps: states, plans;
    and blocks compiled in place (``block.compile()``) at ``budget``. Dropout on, embeddings tied. Fresh process,
    one thread. Writes a JSON summary to ``out_path``."""
    import json

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=128, seq_len=128, n_layer=3, n_head=2, d_model=64, dropout=0.1)

    def run(budget: Any, in_place: bool = False) -> tuple[dict, Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = GPT(cfg)
        for i, block in enumerate(m.blocks):
            if in_place:
                block.compile()
            else:
                m.blocks[i] = torch.compile(block)
        if budget != "stock":
            memrt.auto(m, budget=budget, offload="none", cache=PlanCache())
        _gpt_adamw_steps(m, m, cfg, 5)
        return {k: v.clone() for k, v in m.state_dict().items()}, memrt.plan_of(m)

    ref, _ = run("stock")
    summary: dict[str, Any] = {}
    for budget in (None, budget):
        state, plan = run(budget)
        summary[str(budget)] = {"equal": all(torch.equal(state[k], ref[k]) for k in ref),
                                "actions": {u.name: u.action for u in plan.units},
                                "measured": plan.measured_peak_bytes, "budget": plan.budget_bytes}
    ref, _ = run("stock", in_place=True)  # blocks compiled in place: no per-unit profile, the measured floor
    state, plan = run(budget, in_place=True)
    summary["in_place"] = {"equal": all(torch.equal(state[k], ref[k]) for k in ref),
                           "actions": {u.name: u.action for u in plan.units}, "measured": plan.measured_peak_bytes}
    with open(out_path, "w") as f:
        json.dump(summary, f)


def fsdp_planned(rank: int, world: int, budgets: list[int]) -> dict[str, Any]:
    """FSDP2 (fully_shard per block) without memrt, then with memrt.auto at each budget: gathered states, plans."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import lm_loss

    init(rank, world, "gloo")
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for budget in [None, *budgets]:
        model = tiny_gpt(n_layer=4)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if budget is not None:
            memrt.auto(model, budget=budget, offload="none", cache=PlanCache())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            x, y = _batch(rank, step)
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = {k: v.full_tensor().detach().numpy().tobytes() for k, v in model.state_dict().items()}
        plan = memrt.plan_of(model) if budget is not None else None
        out[str(budget)] = {"state": state, "plan": None if plan is None else {
            "actions": {u.name: u.action for u in plan.units}, "measured": plan.measured_peak_bytes,
            "predicted": plan.predicted_peak_bytes}}
        if budget is not None:
            memrt.disable(model)
    dist.destroy_process_group()
    return out


def compile_floor_check(out_path: str) -> None:
    """A compiled ConvNet (BatchNorm) whose compiled floor is below the eager profile's: at a 1-byte budget
    memrt names the compiled floor it measured (over two steps after the one that compiles); at 97% of the eager
    profile's floor it trains under the budget, state bitwise equal to compiled stock after 6 AdamW steps.
    Fresh process, one thread."""
    import json

    import memrt
    from memrt.memory.cache import PlanCache
    from memrt.testing.models import ConvNet

    torch.set_num_threads(1)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1))

    def run(budget: int | None) -> dict[str, Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = ConvNet(channels=16, n_blocks=4)
        if budget is not None:
            memrt.auto(m, budget=budget, offload="none", cache=PlanCache())
        f = torch.compile(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        try:
            for _ in range(6):
                torch.nn.functional.cross_entropy(f(x), y).backward()
                opt.step()
                opt.zero_grad()
        except memrt.BudgetError as exc:
            return {"error": str(exc), "min_feasible": exc.min_feasible_bytes}
        out: dict[str, Any] = {"state": {k: v.numpy().tobytes().hex() for k, v in m.state_dict().items()}}
        plan = memrt.plan_of(m)
        if plan is not None:
            out.update(actions=[u.action for u in plan.units], measured=plan.measured_peak_bytes,
                       predicted=plan.predicted_peak_bytes, eager_floor=plan.min_feasible_bytes)
        return out

    # the tiny budget first, before the stock run has raised the process's high-water mark: its measured step is
    # then more likely to raise the mark itself, an exact reading (below an earlier mark the meter samples
    # resident memory every millisecond, which can miss a short peak and name too small a floor)
    summary: dict[str, Any] = {"tiny": run(1)}
    summary["stock"] = run(None)
    eager = re.search(r"the eager profile predicted (\d+)", summary["tiny"].get("error", ""))
    if eager:
        summary["eager_floor"] = int(eager.group(1))
        summary["budget"] = int(summary["eager_floor"] * 0.97)
        summary["fits"] = run(summary["budget"])
    with open(out_path, "w") as f:
        json.dump(summary, f)
