"""An unchanged DDP + DistributedSampler training job (it never imports memrt): what MEMRT=1 balances.

    torchrun --standalone --nproc-per-node 2 benchmarks/balance_job.py --steps 40 --out run
    MEMRT=1 torchrun --standalone --nproc-per-node 2 benchmarks/balance_job.py --steps 40 --out run
    BALANCE_JOB_DELAY="1=0.002" MEMRT=1 torchrun ...   # rank 1 sleeps 2 ms per sample in forward (no root)
    BALANCE_JOB_LOAD_DELAY="1=0.002" ...               # ... in its dataset's __getitem__ (a slow input pipeline)

The pattern of the torchrun examples: ``DataLoader(ds, batch_size=b, sampler=DistributedSampler(ds))``,
``sampler.set_epoch(epoch)`` every epoch, a mean-reduced loss, ``loss.backward()``, ``opt.step()``. Each rank
writes ``<out>.rank<N>.json``: the dataset indices of every step, its batch sizes and the timing of the
steps after ``--warmup``; rank 0 adds the final parameters (``<out>.params.pt``) and the loss of the final
model over the whole dataset. ``--iterable`` feeds an IterableDataset instead (no DistributedSampler).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


class Points(Dataset):
    """Random classification points; each item carries its own index so the job can record it."""

    def __init__(self, n: int, features: int, classes: int, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i], i


class PointStream(IterableDataset):
    """The same points as a stream, rank-strided by the job itself (no sampler)."""

    def __init__(self, points: Points, rank: int, world: int) -> None:
        self.points, self.rank, self.world = points, rank, world

    def __iter__(self):
        for i in range(self.rank, len(self.points), self.world):
            yield self.points[i]


def _delay(rank: int, variable: str = "BALANCE_JOB_DELAY") -> float:
    """Seconds of sleep per sample on this rank from ``variable`` ("1=0.002,3=0.004")."""
    for item in filter(None, os.environ.get(variable, "").split(",")):
        r, _, seconds = item.partition("=")
        if int(r) == rank:
            return float(seconds)
    return 0.0


def make_model(features: int, width: int, depth: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16, help="per-rank batch size b (global batch b x world)")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--steps", type=int, default=40, help="stop after this many steps in all")
    p.add_argument("--warmup", type=int, default=12, help="steps not timed")
    p.add_argument("--timed-seconds", type=float, default=0.0,
                   help="instead of --steps: stop this many seconds after the warm-up (concurrent standalone runs "
                        "then share one time window)")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--drop-last", action="store_true", help="DataLoader(drop_last=True)")
    p.add_argument("--sampler-drop-last", action="store_true", help="DistributedSampler(drop_last=True)")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--loss", choices=("mean", "sum"), default="mean")
    p.add_argument("--sync-in-forward", action="store_true",
                   help="all-reduce a statistic at the end of every forward, as SyncBatchNorm does (each rank "
                        "waits there for the slowest one)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    classes = 10
    data = Points(args.samples, args.features, classes, _delay(rank, "BALANCE_JOB_LOAD_DELAY"))
    model = make_model(args.features, args.width, args.depth, classes)
    delay = _delay(rank)
    if delay:
        model.register_forward_hook(lambda _m, inputs, _out: time.sleep(delay * inputs[0].shape[0]))
    if args.sync_in_forward:
        model.register_forward_hook(
            lambda _m, _inputs, out: dist.all_reduce(out.detach().sum()) if torch.is_grad_enabled() else None)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    sampler = None
    if args.iterable:
        loader = DataLoader(PointStream(data, rank, world), batch_size=args.batch, num_workers=args.workers)
    else:
        sampler = DistributedSampler(data, shuffle=not args.no_shuffle, seed=3, drop_last=args.sampler_drop_last)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                            drop_last=args.drop_last)
    steps, sizes, epoch_steps = [], [], []
    t0 = None
    samples_timed = 0
    def done() -> bool:
        if args.timed_seconds > 0:
            return t0 is not None and time.perf_counter() - t0 >= args.timed_seconds
        return len(steps) >= args.steps

    dist.barrier()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        n = 0
        for x, y, idx in loader:
            if len(steps) == args.warmup:
                t0 = time.perf_counter()
            out = ddp(x)
            loss = F.cross_entropy(out, y, reduction=args.loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps.append(idx.tolist())
            sizes.append(len(idx))
            if t0 is not None:
                samples_timed += len(idx)
            n += 1
            if done():
                break
        epoch_steps.append(n)
        if done():
            break
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    dist.barrier()
    record = {"rank": rank, "world": world, "steps": steps, "sizes": sizes, "epoch_steps": epoch_steps,
              "timed_steps": max(0, len(steps) - args.warmup), "timed_seconds": seconds,
              "timed_local_samples": samples_timed, "loader_len": len(loader) if not args.iterable else None}
    if rank == 0:
        with torch.no_grad():
            record["final_loss"] = F.cross_entropy(model(data.x), data.y).item()
        torch.save([p.detach().clone() for p in model.parameters()], f"{args.out}.params.pt")
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
