"""An ordinary GPT-style DDP training script, with no memrt in it (what users already have).

    torchrun --nproc-per-node 4 tests/scripts/train_gpt_ddp.py --steps 200
    MEMRT=1 torchrun --nproc-per-node 4 tests/scripts/train_gpt_ddp.py --steps 200   # memrt switched on

Data: token sequences from a fixed random Markov chain (learnable, so the loss falls), different per
rank and step, identical across runs. Rank 0 prints one JSON line:
``{"tokens_per_s", "step_s", "peak_rss_mib", "final_loss", "steps", "world", ...}``.
``--no-comm`` trains the same model on every rank at the same time without DDP or any collective
during the steps (the compute-only bound); ``--comm-only`` times one all_reduce of the gradients' size
per step (the communication alone). ``--hook fp16|bf16|powersgd`` registers the DDP comm hook torch
ships (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook`` with ``--powersgd-rank``, warm
start and error feedback, compressing from step 2). ``--subset N`` draws every token from a fixed set
of N of the ``--vocab`` tokens (the other embedding rows get all-zero gradients through the input).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2 style init: small weights, so tied logits start near uniform
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def markov_batch(table: torch.Tensor, batch: int, seq: int, gen: torch.Generator,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = table.size(0)
    toks = torch.empty(batch, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(seq):
        toks[:, t + 1] = torch.multinomial(table[toks[:, t]], 1, generator=gen).squeeze(1)
    if tokens is not None:  # chain states -> a fixed subset of the vocabulary
        toks = tokens[toks]
    return toks[:, :-1], toks[:, 1:]


def register_hook(net: DDP, hook: str, powersgd_rank: int) -> None:
    """The DDP comm hooks torch ships (no memrt)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-comm", action="store_true")
    p.add_argument("--comm-only", action="store_true")
    p.add_argument("--hook", choices=("none", "fp16", "bf16", "powersgd"), default="none")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--subset", type=int, default=0, help="draw tokens from this many of the vocabulary (0: all)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    states = args.subset or args.vocab
    table = torch.softmax(3.0 * torch.randn(states, states, generator=torch.Generator().manual_seed(1)), -1)
    tokens = (torch.randperm(args.vocab, generator=torch.Generator().manual_seed(2))[:args.subset]
              if args.subset else None)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [markov_batch(table, args.batch, args.seq, gen, tokens) for _ in range(min(args.steps, 64))]

    if args.comm_only:
        buf = torch.ones(n_params)
        times, cpu = [], []
        for i in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            dist.all_reduce(buf)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        loss_value = float("nan")
    else:
        net = model if args.no_comm else DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        if args.hook != "none" and not args.no_comm:
            try:
                register_hook(net, args.hook, args.powersgd_rank)
            except (TypeError, RuntimeError, ValueError) as exc:  # e.g. a hook that needs CUDA + NCCL
                if rank == 0:
                    print("RESULT " + json.dumps({"error": f"{type(exc).__name__}: {exc}", "hook": args.hook}),
                          flush=True)
                dist.destroy_process_group()
                return
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
        times, cpu, losses = [], [], []
        for i in range(args.steps):
            x, y = batches[i % len(batches)]
            t0, c0 = time.perf_counter(), time.process_time()
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            losses.append(loss.item())
        tail = torch.tensor(sum(losses[-10:]) / len(losses[-10:]))
        dist.all_reduce(tail)
        loss_value = float(tail) / world
    step_s = torch.tensor(sum(times) / max(1, len(times)))
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    # CPU seconds of the whole process (every thread: compute, gloo's and memrt's workers) per step, summed
    # over the ranks: divided by the step time it is how many cores the job kept busy
    cpu_s = torch.tensor(sum(cpu) / max(1, len(cpu)))
    dist.all_reduce(cpu_s)
    peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({
            "tokens_per_s": world * args.batch * args.seq / float(step_s), "step_s": float(step_s),
            "cpu_s_per_step": float(cpu_s),
            "peak_rss_mib": float(peak), "final_loss": loss_value if math.isfinite(loss_value) else None,
            "steps": args.steps, "world": world, "params": n_params,
            "mode": "comm-only" if args.comm_only else "no-comm" if args.no_comm else "ddp",
            "hook": args.hook, "powersgd_rank": args.powersgd_rank if args.hook == "powersgd" else None,
            "losses_finite": all(math.isfinite(v) for v in losses) if not args.comm_only else None}), flush=True)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
