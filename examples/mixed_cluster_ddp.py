"""A plain DDP job for a mixed cluster: nodes with different rank counts and ranks of different speeds.

It does not import memrt: ``DistributedSampler`` + ``DataLoader(batch_size=b)``, as torchrun examples have it.
On two real nodes, one with 2 ranks and one with 1 (any address the nodes share for the rendezvous):

    # node 0                                                  # node 1
    MEMRT=1 torchrun --nnodes 2 --node-rank 0 \\               MEMRT=1 torchrun --nnodes 2 --node-rank 1 \\
        --nproc-per-node 2 --rdzv-backend c10d \\                 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint NODE0:29500 \\                             --rdzv-endpoint NODE0:29500 \\
        examples/mixed_cluster_ddp.py                             examples/mixed_cluster_ddp.py

On one machine, the same layout with rank 2 held to a slower pace (``--slow 2=0.002``: 2 ms per sample, a
stand-in for an older GPU or a CPU helper) and the nodes given to memrt:

    MEMRT=1 MEMRT_TOPOLOGY="0,1;2" torchrun --standalone --nproc-per-node 3 examples/mixed_cluster_ddp.py \\
        --slow 2=0.002

Under ``MEMRT=1`` memrt measures each rank's compute speed, gives each rank a share of every global batch in
proportion to it (the same samples per step as stock, the gradient weighted by each share), runs the
gradient all-reduce hierarchically across the nodes, and prints its decision (shares, speeds, predicted
gain). ``MEMRT_BALANCE=off`` keeps stock's equal shares. Rank 0 prints samples/s and the final loss.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size of stock DDP")
    p.add_argument("--samples", type=int, default=3072)
    p.add_argument("--slow", default="", help="RANK=SECONDS: that rank sleeps SECONDS per sample in forward")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pause = 0.0
    if args.slow:
        slow_rank, _, seconds = args.slow.partition("=")
        pause = float(seconds) if int(slow_rank) == rank else 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 64, generator=g)
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=args.batch, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))
    if pause:
        model.register_forward_hook(lambda _m, inputs, _o: time.sleep(pause * inputs[0].shape[0]))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    samples, start, loss = 0, time.perf_counter(), torch.tensor(0.0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(ddp(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(xb)
    elapsed = time.perf_counter() - start
    total = torch.tensor([float(samples)])
    dist.all_reduce(total)
    dist.all_reduce(loss.detach().mul_(1.0 / world))
    if rank == 0:
        print(f"{total.item() / elapsed:.0f} samples/s over {world} ranks, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
