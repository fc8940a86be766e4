"""Shared inputs and the documented reference reduction for the comm tests (imported by workers).

Reference order (what memrt.comm's hierarchical all-reduce promises, bit for bit):
``node_0 (op) node_1 (op) ...`` with ``node_i = r_0 (op) r_1 (op) ... `` over the node's ranks in
local order, left to right, in the tensor's dtype; AVG = that SUM divided by the world size.
"""

from __future__ import annotations

import torch

OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
MIB64 = 64 * 1024 * 1024


_BASES: dict = {}


def _base(numel: int, dtype: torch.dtype, product: bool) -> torch.Tensor:
    key = (numel, dtype, product)
    if key not in _BASES:
        g = torch.Generator().manual_seed(numel % 100003)
        if dtype.is_floating_point:
            b = (torch.rand(numel, generator=g) + 0.5) if product else torch.randn(numel, generator=g) * 3
        elif product:
            b = torch.randint(-3, 4, (numel,), generator=g, dtype=torch.int64)
        else:
            b = torch.randint(-(2 ** 40), 2 ** 40, (numel,), generator=g, dtype=torch.int64)
        _BASES.clear()  # keep one base alive (64 MiB cases)
        _BASES[key] = b.to(dtype)
    return _BASES[key]


def make_input(rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Rank ``rank``'s input: one random base rolled by a rank-dependent shift (cheap, distinct per rank)."""
    base = _base(numel, dtype, op == "PRODUCT")
    return torch.roll(base, 7919 * rank + rank * rank) if numel > 1 else base * (rank + 1)


def combine(acc: torch.Tensor, x: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("SUM", "AVG"):
        return acc + x
    if op == "PRODUCT":
        return acc * x
    return torch.minimum(acc, x) if op == "MIN" else torch.maximum(acc, x)


def reference(inputs: list[torch.Tensor], nodes, op: str) -> torch.Tensor:
    total = None
    for node in nodes:
        acc = inputs[node[0]].clone()
        for r in node[1:]:
            acc = combine(acc, inputs[r], op)
        total = acc if total is None else combine(total, acc, op)
    if op == "AVG":
        total = total / len(inputs)
    return total


def compare(tag: str, mine: torch.Tensor, ref: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype,
            failures: list[str]) -> None:
    """Append to ``failures`` unless ``mine`` equals the reference order bit for bit and is close to
    torch.distributed's result (equal for integers)."""
    if not torch.equal(mine, ref):
        bad = (mine != ref).nonzero()[:3].flatten().tolist()
        failures.append(f"{tag}: differs from the reference order at {bad}")
    if dtype.is_floating_point:
        tol = 1e-5 if dtype == torch.float32 else 0.1
        if not torch.allclose(mine.float(), theirs.float(), rtol=tol, atol=tol):
            failures.append(f"{tag}: not close to torch.distributed's")
    elif not torch.equal(mine, theirs):
        failures.append(f"{tag}: differs from torch.distributed's")
