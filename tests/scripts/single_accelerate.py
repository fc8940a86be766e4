"""An unchanged accelerate job run without a launcher (``python``, one process; no memrt import).

    python tests/scripts/single_accelerate.py --steps 3 --out params.pt
    MEMRT=1 MEMRT_BUDGET=60% python tests/scripts/single_accelerate.py --steps 3 --out params.pt

Saves the final ``state_dict`` to ``--out``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1)) for _ in range(3)]
    model = nn.Sequential(nn.Linear(32, 64), *blocks, nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)),
                        batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    state = accelerator.unwrap_model(model).state_dict()
    torch.save({k: v.detach().clone() for k, v in state.items()}, args.out)


if __name__ == "__main__":
    main()
