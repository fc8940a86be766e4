"""The reduction vocabulary every tier shares: op names, the element-wise combine, a finished operation.

Below :mod:`memrt.comm.tiers` (the tiers' interface and the torch groups) and the shared-memory tier
(:mod:`memrt.comm.shm`), which both reduce with it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DONE", "REDUCE_OPS", "Done", "combine", "combine_", "op_name"]

REDUCE_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")


def op_name(op: Any) -> str:
    """'SUM' | 'AVG' | 'MIN' | 'MAX' | 'PRODUCT' from a ReduceOp, its type or a string."""
    if op is None:
        return "SUM"
    name = op if isinstance(op, str) else getattr(op, "name", None) or str(op)
    name = str(name).split(".")[-1].upper()
    if name not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported by memrt.comm: expected one of {', '.join(REDUCE_OPS)} "
                         "(other ops: call torch.distributed directly)")
    return name


def combine(a: torch.Tensor, b: torch.Tensor, op: str, *, out: torch.Tensor) -> torch.Tensor:
    """``out = a (op) b`` in one pass (``out`` may alias ``a`` or ``b``; AVG combines as SUM)."""
    if op in ("SUM", "AVG"):
        return torch.add(a, b, out=out)
    if op == "PRODUCT":
        return torch.mul(a, b, out=out)
    if op == "MIN":
        return torch.minimum(a, b, out=out)
    return torch.maximum(a, b, out=out)


def combine_(acc: torch.Tensor, x: torch.Tensor, op: str) -> torch.Tensor:
    """``acc = acc (op) x`` in place, in ``acc``'s dtype (AVG combines as SUM)."""
    return combine(acc, x, op, out=acc)


class Done:
    """A finished operation (same interface as a torch Work)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()
