"""An unchanged accelerate training script (no memrt import): an MLP, 2 ranks under torchrun.

    MEMRT=1 torchrun --standalone --nproc-per-node 2 tests/scripts/accelerate_job.py --out run

``BALANCE_JOB_DELAY="1=0.002"`` makes rank 1 sleep 2 ms per sample in forward (a slow rank without root).
Each rank writes ``<out>.rank<N>.json`` (batch size of every step, the dataset indices it used); rank 0
saves the final parameters to ``<out>.params.pt``.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    delay = 0.0
    for item in filter(None, os.environ.get("BALANCE_JOB_DELAY", "").split(",")):
        r, _, s = item.partition("=")
        delay = float(s) if int(r) == rank else delay
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    if delay:
        model.register_forward_hook(lambda _m, a, _o: time.sleep(delay * a[0].shape[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Points(400), batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    steps, sizes = [], []
    for _epoch in range(args.epochs):
        for x, y, idx in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            steps.append(idx.tolist())
            sizes.append(len(idx))
            if len(steps) >= args.steps:
                break
        if len(steps) >= args.steps:
            break
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "sizes": sizes, "steps": steps}, f)
    if rank == 0:
        torch.save([p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], f"{args.out}.params.pt")
    accelerator.end_training() if hasattr(accelerator, "end_training") else None
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
