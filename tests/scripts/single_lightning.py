"""An unchanged PyTorch Lightning job on one CPU device (no memrt import, no launcher).

    python tests/scripts/single_lightning.py --steps 3 --out params.pt
    MEMRT=1 MEMRT_BUDGET=60% python tests/scripts/single_lightning.py --steps 3 --out params.pt

Saves the final ``state_dict`` to ``--out``.
"""

import argparse

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)])
        self.out = nn.Linear(64, 4)

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
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=f"{args.out}.pl")
    trainer.fit(model, DataLoader(data, batch_size=8))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
