"""Unchanged single-process training scripts (no memrt import, no process group): what a team already has.

    python tests/scripts/single_jobs.py loop --steps 4 --out params.pt     # one model, AdamW, dropout on
    python tests/scripts/single_jobs.py gan --steps 4 --out params.pt      # two models, two optimizers
    python tests/scripts/single_jobs.py infer --out params.pt              # builds a model, trains nothing
    MEMRT=1 MEMRT_BUDGET=60% python tests/scripts/single_jobs.py loop --steps 4 --out params.pt

Each job saves its final ``state_dict`` (every model's, keys prefixed per model) to ``--out``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 32, 32, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp_stack(n_in: int, n_out: int, width: int = 64, depth: int = 3) -> nn.Sequential:
    """An MLP of ``depth`` identical hidden blocks (memrt's units), dropout inside each."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LeakyReLU(0.2), nn.Dropout(0.1)) for _ in range(depth)]
    return nn.Sequential(nn.Linear(n_in, width), *blocks, nn.Linear(width, n_out))


def loop(steps: int) -> dict[str, torch.Tensor]:
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, VOCAB, (steps * 4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        x, y = data[step * 4:(step + 1) * 4, :-1], data[step * 4:(step + 1) * 4, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():  # an evaluation forward between steps
            model.eval()
            model(x)
            model.train()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    return model.state_dict()


def gan(steps: int) -> dict[str, torch.Tensor]:
    gen, disc = mlp_stack(16, 8), mlp_stack(8, 1)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    real_data = torch.randn(steps * 16, 8, generator=torch.Generator().manual_seed(2)) * 0.5 + 1.0
    for step in range(steps):
        real = real_data[step * 16:(step + 1) * 16]
        fake = gen(torch.randn(16, 16))
        d_loss = (F.binary_cross_entropy_with_logits(disc(real), torch.ones(16, 1))
                  + F.binary_cross_entropy_with_logits(disc(fake.detach()), torch.zeros(16, 1)))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(16, 1))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        print(f"step {step} d {d_loss.item():.6f} g {g_loss.item():.6f}", flush=True)
    return {**{f"gen.{k}": v for k, v in gen.state_dict().items()},
            **{f"disc.{k}": v for k, v in disc.state_dict().items()}}


def infer(steps: int) -> dict[str, torch.Tensor]:
    model = TinyGPT().eval()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randint(0, VOCAB, (2, SEQ)))
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=("loop", "gan", "infer"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {"loop": loop, "gan": gan, "infer": infer}[args.job](args.steps)
    torch.save({k: v.detach().clone() for k, v in state.items()}, args.out)


if __name__ == "__main__":
    main()
