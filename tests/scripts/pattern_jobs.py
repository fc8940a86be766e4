"""Unchanged training patterns real jobs use, several in one launch (nothing of memrt in it).

Each pattern builds its own tiny model from seed 0, trains a few steps on data drawn from private generators
(per step and rank) and rank 0 saves the final state to ``<out>/<pattern>.pt``; timings go to
``<out>/times-<rank>.json``. The patterns run one after another in the same ranks (one process group), so a
test pays the ranks' start-up once:

    plain      DDP, AdamW (the reference for the DCP patterns)
    no_sync    gradient accumulation: 2 micro-batches per step, the first under ``ddp.no_sync()``
    unused     DDP(find_unused_parameters=True), a branch used on even steps only
    static     DDP(static_graph=True)
    autocast   forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``
    gan        two DDP models (generator, discriminator), two optimizers
    compile    ``torch.compile(DDP(model))`` (inductor; DDPOptimizer splits the graph at buckets)
    compile_inner  ``DDP(torch.compile(model))`` (compiled before DDP wraps it)
    dcp_ddp    DDP: save model + optimizer with torch.distributed.checkpoint after step K, a fresh model and
               optimizer load it and train to the end (equal to ``plain``)
    fsdp2      FSDP2 (fully_shard per block + root), AdamW; the full state gathered (reference for dcp_fsdp2)
    dcp_fsdp2  FSDP2 with the same DCP save / fresh load / continue
    ckpt       DDP on a deep narrow MLP (16 blocks of width 64, batch 2048: memrt's disk tier fits a tight budget), a DCP checkpoint after every step, resumed from ``--ckpt`` when one
               is there; ``--kill-at K --marker FILE``: rank 1 creates FILE and exits with os._exit(1) at
               step K when FILE does not exist yet (under ``torchrun --max-restarts 1`` the next attempt
               resumes)

    torchrun --standalone --nproc-per-node 2 tests/scripts/pattern_jobs.py --out OUT --patterns plain,no_sync
    MEMRT=1 torchrun --standalone --nproc-per-node 2 tests/scripts/pattern_jobs.py --out OUT --patterns all
    MEMRT=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/pattern_jobs.py \\
        --out OUT --patterns ckpt --ckpt OUT/ckpt --kill-at 3 --marker OUT/killed
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, STEPS, K = 16, 4, 2
ALL = ["plain", "no_sync", "unused", "static", "autocast", "gan", "compile", "compile_inner", "dcp_ddp", "fsdp2", "dcp_fsdp2"]


class MLP(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Branchy(nn.Module):
    """Branch ``a`` on even steps, branch ``b`` on odd ones: the other gets no gradient that step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.a, self.b = nn.Linear(WIDTH, 4), nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = F.gelu(self.trunk(x))
        return self.a(h) if use_a else self.b(h)


def batch(step: int, micro: int = 0, n: int = 8, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * dist.get_rank() + 100 * step + micro)
    return torch.randn(n, width, generator=g), torch.randint(0, 4, (n,), generator=g)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def ddp_steps(ddp: DDP, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def fresh_ddp(**kw) -> tuple[nn.Module, DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model, **kw)
    return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def p_plain() -> dict:
    model, ddp, opt = fresh_ddp()
    ddp_steps(ddp, opt, range(STEPS))
    return state(model)


def p_no_sync() -> dict:
    model, ddp, opt = fresh_ddp()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with ddp.no_sync():  # local accumulation, no all-reduce
            x, y = batch(step, 0)
            (F.cross_entropy(ddp(x), y) / 2).backward()
        x, y = batch(step, 1)
        (F.cross_entropy(ddp(x), y) / 2).backward()  # all-reduces the accumulated gradients
        opt.step()
    return state(model)


def p_unused() -> dict:
    torch.manual_seed(0)
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(ddp(x, step % 2 == 0), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return state(model)


def p_static() -> dict:
    model, ddp, opt = fresh_ddp(static_graph=True)
    ddp_steps(ddp, opt, range(STEPS))
    return state(model)


def p_autocast() -> dict:
    model, ddp, opt = fresh_ddp()
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return state(model)


def p_gan() -> dict:
    torch.manual_seed(0)
    gen, disc = MLP(), nn.Sequential(nn.Linear(4, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))
    g_ddp, d_ddp = DDP(gen), DDP(disc)
    g_opt = torch.optim.Adam(g_ddp.parameters(), lr=1e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(d_ddp.parameters(), lr=1e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        z, _ = batch(step, 0)
        real, _ = batch(step, 1, width=4)
        fake = g_ddp(z)
        d_opt.zero_grad(set_to_none=True)
        d_loss = bce(d_ddp(real), torch.ones(8, 1)) + bce(d_ddp(fake.detach()), torch.zeros(8, 1))
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad(set_to_none=True)
        bce(d_ddp(fake), torch.ones(8, 1)).backward()  # also fills D's grads: zeroed before D's next step
        g_opt.step()
    return {**{f"gen.{k}": v for k, v in state(gen).items()}, **{f"disc.{k}": v for k, v in state(disc).items()}}


def p_compile() -> dict:
    model, ddp, opt = fresh_ddp()
    ddp_steps(torch.compile(ddp), opt, range(STEPS))
    return state(model)


def p_compile_inner() -> dict:
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(torch.compile(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ddp_steps(ddp, opt, range(STEPS))
    return state(model)


def _dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def p_dcp_ddp(out: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    path = str(out / "dcp_ddp.ckpt")
    model, ddp, opt = fresh_ddp()
    ddp_steps(ddp, opt, range(K))
    dcp.save(_dcp_state(ddp, opt), checkpoint_id=path)
    del model, ddp, opt
    torch.manual_seed(1)  # a different init: the load must overwrite all of it
    model = MLP()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    _dcp_load(ddp, opt, path)
    ddp_steps(ddp, opt, range(K, STEPS))
    return state(model)


def _fsdp2(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def p_fsdp2() -> dict:
    model, opt = _fsdp2()
    ddp_steps(model, opt, range(STEPS))
    return _full_state(model)


def p_dcp_fsdp2(out: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    path = str(out / "dcp_fsdp2.ckpt")
    model, opt = _fsdp2()
    ddp_steps(model, opt, range(K))
    dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    del model, opt
    model, opt = _fsdp2(seed=1)
    _dcp_load(model, opt, path)
    ddp_steps(model, opt, range(K, STEPS))
    return _full_state(model)


def p_ckpt(out: Path, args: argparse.Namespace) -> dict:
    """Checkpoint after every step; resume from the newest one; rank 1 dies once at --kill-at."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP(width=64, depth=16)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ckpt = Path(args.ckpt or out / "ckpt")
    start = 0
    done = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / ".metadata").exists())
    if done:
        _dcp_load(ddp, opt, str(ckpt / f"step-{done[-1]}"))
        start = done[-1] + 1
    (out / f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-rank{rank}.json").write_text(
        json.dumps({"pid": os.getpid(), "start": start}))
    for step in range(start, args.ckpt_steps):
        if step == args.kill_at and rank == 1 and args.marker and not os.path.exists(args.marker):
            Path(args.marker).write_text(str(os.getpid()))
            os._exit(1)  # a crash: no atexit, no clean-up
        x, y = batch(step, n=2048, width=64)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dcp.save(_dcp_state(ddp, opt), checkpoint_id=str(ckpt / f"step-{step}"))
    return state(model)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--patterns", default="all", help="comma-separated names, or all")
    p.add_argument("--ckpt", default=None, help="checkpoint folder of the ckpt pattern (default OUT/ckpt)")
    p.add_argument("--ckpt-steps", type=int, default=6)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--marker", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)  # bitwise comparisons of compiled runs need one thread (inductor's reductions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = ALL if args.patterns == "all" else args.patterns.split(",")
    runners = {"dcp_ddp": lambda: p_dcp_ddp(out), "dcp_fsdp2": lambda: p_dcp_fsdp2(out),
               "ckpt": lambda: p_ckpt(out, args)}
    times = {}
    for name in names:
        t0 = time.perf_counter()
        result = runners[name]() if name in runners else globals()[f"p_{name}"]()
        times[name] = round(time.perf_counter() - t0, 3)
        if rank == 0:
            torch.save(result, out / f"{name}.pt")
            print(f"pattern {name} done in {times[name]:.2f} s", flush=True)
    (out / f"times-{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
