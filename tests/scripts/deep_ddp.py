"""An unchanged DDP training script with a deep stack of narrow blocks (nothing of memrt in it).

Each block's input is large next to what its replay needs, so below "every block recomputed" only a plan that
also offloads the blocks' inputs fits: memrt's offload fault tests use it to make the disk tier necessary.

    MEMRT=1 MEMRT_OFFLOAD=disk MEMRT_BUDGET=6MB torchrun --standalone --nproc-per-node 2 tests/scripts/deep_ddp.py
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class Deep(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Deep(args.width, args.depth))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
