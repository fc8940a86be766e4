"""An unchanged DDP training script whose data pipeline draws from every global generator.

    torchrun --nproc-per-node 2 tests/scripts/rng_train.py --steps 4 --out result.json
    MEMRT=1 MEMRT_BUDGET=... torchrun --nproc-per-node 2 tests/scripts/rng_train.py --steps 4 --out result.json

Each step draws from Python's ``random`` (sample order), numpy's global state (input noise) and torch's
default generator (dropout, and a shuffle); after each step every rank records a digest of all
generators' states. Rank 0 writes the digests of every rank and the final parameters to ``--out``
(a torch file), so a run with memrt can be compared with one without, step by step.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

WIDTH, LAYERS, BATCH = 64, 4, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def digest() -> str:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(keys.tobytes() + repr((name, pos, has_gauss, cached, random.getstate())).encode())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    data = torch.randn(4 * BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    digests = []
    for _ in range(args.steps):
        rows = random.sample(range(len(data)), BATCH)
        x = data[rows] + torch.from_numpy(np.random.normal(0, 0.1, (BATCH, WIDTH)).astype(np.float32))
        x = x[torch.randperm(BATCH)]
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()
        digests.append(digest())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    if rank == 0:
        torch.save({"digests": everyone, "params": {k: v.clone() for k, v in model.state_dict().items()}}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
