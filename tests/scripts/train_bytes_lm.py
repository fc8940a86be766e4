"""A byte-level GPT trained on the Python standard library's own source files (on every machine, no download).

An unchanged DDP job (no memrt import; ``MEMRT=1`` acts on it from outside). Files are sorted by path; every
10th is held out for evaluation, the rest are training text. Every rank samples training windows with its own
generator (the same windows in every arm); rank 0 evaluates on a fixed set of held-out windows every
``--eval-every`` steps and at the end, and prints one ``RESULT {json}`` line: tokens/s of training (evaluation
time left out), the curve ``[step, tokens, train seconds, eval loss]`` and the final eval loss.

``--post-local-sgd H``: torch's post-local SGD, the anchor of the low-communication arms: gradients averaged
within each node (``post_localSGD_hook`` on a per-node subgroup) and parameters averaged over every rank
every H steps (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``), both after ``--warmup`` global steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def corpus(limit_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes) from the standard library's .py files, each at most ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        into = held if i % 10 == 0 else train
        if len(into) < limit_bytes:
            into += path.read_bytes()[: limit_bytes - len(into)]
    return torch.frombuffer(bytes(train), dtype=torch.uint8).long(), torch.frombuffer(bytes(held), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def windows(data: torch.Tensor, starts: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(ctx + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=8_000_000)
    p.add_argument("--post-local-sgd", type=int, default=0, metavar="H")
    p.add_argument("--warmup", type=int, default=0, help="global steps before post-local SGD starts")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held = corpus(args.corpus_bytes)
    torch.manual_seed(0)
    model = ByteGPT(args.d, args.layers, args.heads, args.ctx)
    ddp = DDP(model)
    opt: torch.optim.Optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    if args.post_local_sgd:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                      post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
        node_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(n, n + per_node)) for n in range(0, world, per_node)])
        ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=node_group,
                                                 start_localSGD_iter=args.warmup), post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=opt, averager=PeriodicModelAverager(period=args.post_local_sgd,
                                                                              warmup_steps=args.warmup))
    gen = torch.Generator().manual_seed(1234 + rank)
    eval_gen = torch.Generator().manual_seed(99)
    eval_starts = torch.randint(0, held.numel() - args.ctx - 1, (args.eval_windows,), generator=eval_gen)
    ex, ey = windows(held, eval_starts, args.ctx)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(ex[i:i + 16]).flatten(0, 1), ey[i:i + 16].flatten()).item()
                      for i in range(0, len(ex), 16)]
        model.train()
        return sum(losses) / len(losses)

    curve = []
    train_s = 0.0
    tokens_per_step = args.batch * args.ctx * world
    if rank == 0:
        curve.append([0, 0, 0.0, evaluate()])
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train.numel() - args.ctx - 1, (args.batch,), generator=gen)
        x, y = windows(train, starts, args.ctx)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            train_s += time.perf_counter() - start
            if rank == 0:
                curve.append([step, step * tokens_per_step, train_s, evaluate()])
            dist.barrier()  # evaluation time stays out of every rank's training time
            start = time.perf_counter()
    if rank == 0:
        final = curve[-1][3]
        print("RESULT " + json.dumps({
            "tokens_per_s": args.steps * tokens_per_step / train_s, "step_s": train_s / args.steps,
            "train_seconds": train_s, "steps": args.steps, "tokens_per_step": tokens_per_step,
            "final_eval_loss": final, "curve": curve, "train_bytes": train.numel(), "held_bytes": held.numel(),
            "parameters": sum(p.numel() for p in model.parameters()), "finite": math.isfinite(final)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
