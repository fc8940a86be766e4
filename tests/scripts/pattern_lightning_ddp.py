"""An unchanged PyTorch Lightning DDP job: Lightning starts the second rank itself (no launcher, no memrt import).

    python tests/scripts/pattern_lightning_ddp.py --steps 3 --out params.pt
    MEMRT=1 python tests/scripts/pattern_lightning_ddp.py --steps 3 --out params.pt

``strategy="ddp"`` on ``accelerator="cpu", devices=2``: Lightning re-runs this script for rank 1 (its subprocess
launcher), joins a gloo group, wraps the module in DDP and shards the DataLoader with a DistributedSampler.
Rank 0 saves the final ``state_dict`` to ``--out``; each rank writes ``<out>.rank<N>.json`` (pid, world size).
"""

import argparse
import json
import os
import time

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2)])
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))

    def training_step(self, batch, _index):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=f"{args.out}.pl")
    trainer.fit(model, DataLoader(data, batch_size=8))
    import torch.distributed as dist

    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"pid": os.getpid(), "world": dist.get_world_size() if dist.is_initialized() else 1,
                   "module": type(trainer.strategy.model).__name__}, f)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    time.sleep(0.05)


if __name__ == "__main__":
    main()
