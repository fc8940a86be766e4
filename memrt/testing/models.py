"""Small models that exercise what real training does, shared by tests, examples and benchmarks.

- :class:`GPT`: GPT-style decoder (tied embeddings, dropout, blocks in a ModuleList).
- :class:`ConvNet`: a CNN with BatchNorm (forward mutates running stats).
- :class:`KwargsMLP`: blocks called with keyword arguments and returning tuples.
- :class:`SharedBlockNet`: one submodule used at two places in the forward.
- :class:`LongSkipMLP`: a U-Net-like MLP whose encoder outputs are consumed again by the decoder units
  (gradients from several units summed at one tensor), dropout in the encoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "ConvNet", "KwargsMLP", "LongSkipMLP", "SharedBlockNet", "gpt_batch", "lm_loss"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens in the vocabulary."""
    seq_len: int = 128
    """Context length in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.1
    """Dropout probability (attention output and MLP)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_batch(cfg: GPTConfig, batch_size: int, *, seed: int = 0, device: str | torch.device = "cpu"):
    """(inputs, targets) of random tokens, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """A small ResNet-like CNN; BatchNorm running stats change in every training forward."""

    def __init__(self, channels: int = 16, n_blocks: int = 4, n_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(n_blocks)))
        self.head = nn.Linear(channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class KwBlock(nn.Module):
    """Called as block(x, scale=s); returns (hidden, aux) so callers must unpack tuples."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(F.gelu(self.fc1(x)))
        y = x + scale * self.fc2(h)
        return y, h.mean(dim=-1)


class KwargsMLP(nn.Module):
    def __init__(self, width: int = 64, n_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KwBlock(width) for _ in range(n_blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux_total = 0.0
        for i, block in enumerate(self.blocks):
            x, aux = block(x, scale=1.0 / (i + 1))
            aux_total = aux_total + aux.mean()
        return self.out(x).squeeze(-1) + 0.01 * aux_total


class SharedBlockNet(nn.Module):
    """``shared`` runs twice per forward (shared parameters); ``blocks`` are ordinary units."""

    def __init__(self, width: int = 64, n_blocks: int = 3) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        x = self.shared(x)
        return self.out(x).squeeze(-1)


class EncoderUnit(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(x)))


class DecoderUnit(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(torch.cat([x, skip], dim=-1)))


class LongSkipMLP(nn.Module):
    """Encoder units whose outputs feed the next encoder unit and, later, the mirrored decoder unit."""

    def __init__(self, width: int = 64, depth: int = 6, dropout: float = 0.1) -> None:
        super().__init__()
        self.enc = nn.ModuleList(EncoderUnit(width, dropout) for _ in range(depth))
        self.dec = nn.ModuleList(DecoderUnit(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for unit in self.enc:
            x = unit(x)
            skips.append(x)
        for unit in self.dec:
            x = unit(x, skips.pop())
        return self.out(x).squeeze(-1)
