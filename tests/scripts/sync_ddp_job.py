"""An unchanged DDP job (no memrt import): a small MLP, gloo, N steps of AdamW; every rank saves its final
parameters to OUT/rank{R}.pt (after destroy_process_group unless --no-destroy). Run under MEMRT=1 by tests/test_sync_activation.py."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-destroy", action="store_true", help="exit without destroy_process_group")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if not args.no_destroy:
        dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{args.out}/rank{rank}.pt")


if __name__ == "__main__":
    main()
