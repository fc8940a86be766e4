"""An FSDP2 + torch.compile LLM training loop in the torchtitan style; it does not import memrt.

``fully_shard`` per transformer block, then on the model; optional ``torch.compile`` of each block
(torchtitan compiles per block); AdamW; rank 0 saves the gathered final state. memrt runs it unchanged:

    torchrun --standalone --nproc-per-node 4 examples/fsdp2_compile_train.py --steps 5
    MEMRT=1 torchrun --standalone --nproc-per-node 4 examples/fsdp2_compile_train.py --steps 5
    MEMRT=1 MEMRT_TOPOLOGY="0,1;2,3" MEMRT_BUDGET=12MB torchrun --standalone --nproc-per-node 4 \\
        examples/fsdp2_compile_train.py --steps 5 --compile --out state.pt

Under ``MEMRT=1`` memrt swaps gloo for its process group (FSDP2's all-gathers and reduce-scatters go
through memrt.comm and its comm log, by tier), plans the model's memory with the sharded blocks as units,
and prints one banner and a summary. ``--device cuda`` uses NCCL (one GPU per rank).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w2, self.w3 = (nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False),
                                     nn.Linear(dim, 4 * dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))  # SwiGLU, as in Llama


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) / math.sqrt(dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--compile", action="store_true", help="torch.compile each block (torchtitan's way)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="rank 0 saves the gathered final state here")
    args = p.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)
    model = Transformer(vocab=256, dim=args.dim, heads=4, layers=args.layers, seq=args.seq).to(device)
    for i, layer in enumerate(model.layers):
        if args.compile:
            layer = torch.compile(layer)
            model.layers[i] = layer
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data shard
    for step in range(args.steps):
        data = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    state = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}  # collective: every rank
    if rank == 0 and args.out:
        torch.save(state, args.out)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
