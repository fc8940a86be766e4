"""An unchanged DDP job with known waits, for the exit summary's step split (tests/test_step_split.py).

Each batch takes DATA_S to load (in the main process), each step ends with OTHER_S of the script's own work
after ``optimizer.step()``, and rank 1's forward takes SLOW_S longer (a slower rank: rank 0 waits for it at the
end of its backward); every rank writes the perf_counter time of each optimizer step's end to OUT/rank{R}.json.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DATA_S, OTHER_S, SLOW_S = 0.004, 0.02, 0.01


class Slow(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        time.sleep(DATA_S / 8)  # a batch of 8 samples: DATA_S per batch
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.randn(8, generator=g)


class Net(torch.nn.Sequential):
    def __init__(self, delay_s: float) -> None:
        super().__init__(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
        self.delay_s = delay_s

    def forward(self, x):
        time.sleep(self.delay_s)
        return super().forward(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(SLOW_S if rank == 1 else 0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Slow()
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
    ends = []
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ends.append(time.perf_counter())
        time.sleep(OTHER_S)
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump({"ends": ends, "data_s": DATA_S, "other_s": OTHER_S, "slow_s": SLOW_S}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
