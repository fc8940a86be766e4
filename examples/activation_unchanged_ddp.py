"""An ordinary DDP training script, with nothing of memrt in it: memrt is switched on from outside.

Run it as it is (stock), then with memrt, on one machine (gloo, 2 processes):

    torchrun --standalone --nproc-per-node 2 examples/activation_unchanged_ddp.py
    MEMRT=1 MEMRT_BUDGET=85% torchrun --standalone --nproc-per-node 2 examples/activation_unchanged_ddp.py
    MEMRT=1 mpiexec -n 2 python examples/activation_unchanged_ddp.py
    memrt run --budget 85% -- torchrun --standalone --nproc-per-node 2 examples/activation_unchanged_ddp.py

With MEMRT=1, rank 0 prints memrt's banner (every setting and where it came from), memrt plans the
memory of the DDP model against each rank's own budget, routes the gradient all-reduce through
memrt.comm, and at exit each rank writes ./memrt-report/<run id>/rank<N>.json and rank 0 prints a summary.
``memrt run`` does the same without the start-up hook that ``pip install memrt`` puts in site-packages.

Settings that decide which collectives run (MEMRT, MEMRT_TOPOLOGY, MEMRT_COMM, MEMRT_COMPRESS, MEMRT_OFFLOAD)
are compared across ranks right after init_process_group; ranks that differ stop with one line, exit 2:

    printf '#!/bin/bash\nv=R${LOCAL_RANK}ENV; [ -n "${!v}" ] && export ${!v}\nexec python "$@"\n' > wrap.sh
    chmod +x wrap.sh
    R0ENV="MEMRT_TOPOLOGY=0,1" R1ENV="MEMRT_TOPOLOGY=0;1" MEMRT=1 MEMRT_COMM=hier \
        torchrun --standalone --nproc-per-node 2 --no-python ./wrap.sh examples/activation_unchanged_ddp.py
    # memrt: error: settings that every rank must share differ: MEMRT_TOPOLOGY: '0,1' on rank 0, '0;1' on rank 1; ...
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
