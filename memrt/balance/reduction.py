"""What memrt can know about a loss's reduction: the root of the autograd graph that ``backward`` starts from.

memrt never sees the loss function; it sees the tensor the job calls ``backward()`` on. Its ``grad_fn``
and the nodes just below it say how the loss was reduced over the rank's samples:

- ``mean``: a mean-reducing loss node (``reduction='mean'``: NllLoss / cross_entropy, MSE, BCE, ...) or
  ``tensor.mean()`` over all elements, possibly multiplied or divided by constants (gradient accumulation,
  GradScaler's scale), or a sum of such terms;
- ``sum``: a sum-reducing node (``reduction='sum'``, ``tensor.sum()``), possibly *multiplied* by constants;
- ``unknown``: anything else — a sum divided by a tensor (a hand-made mean over a local count, or the HF
  Trainer's division by the tokens of the whole global batch: the two need opposite weightings), a
  per-dimension mean, ``reduction='none'`` followed by custom code, several roots, a non-scalar root.

Balancing needs the kind: with a mean-reduced loss rank r's gradient is weighted by ``n_r * W / B``
before DDP's averaging; with a sum-reduced loss DDP's averaging is already right for any split.
"""

from __future__ import annotations

from typing import Any

__all__ = ["classify_loss", "describe_loss", "MEAN", "SUM", "UNKNOWN"]

MEAN, SUM, UNKNOWN = "mean", "sum", "unknown"
_REDUCTION_ATTR = "_saved_reduction"  # torch's Reduction enum: 0 none, 1 mean, 2 sum
_SCALE = ("MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0")
_ADD = ("AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1")
_MAX_DEPTH = 8


_PASS_THROUGH = ("_DDPSinkBackward",)  # DDP's identity node over the forward's outputs (find_unused_parameters)


def _edges(fn: Any) -> list[tuple[Any, int]]:
    return [(f, nr) for f, nr in getattr(fn, "next_functions", ()) if f is not None]


def _branches(fn: Any) -> list[Any]:
    return [f for f, _ in _edges(fn)]


def _through(fn: Any, nr: int) -> tuple[Any, int]:
    """Skip identity nodes that carry several outputs: output ``nr`` comes from their input ``nr``."""
    while fn is not None and type(fn).__name__ in _PASS_THROUGH:
        nexts = getattr(fn, "next_functions", ())
        if nr >= len(nexts):
            return None, 0
        fn, nr = nexts[nr]
    return fn, nr


def _constant_other(fn: Any) -> bool:
    """True when a Mul/Div node's second operand needs no gradient (one graph branch)."""
    return len(_branches(fn)) == 1


def _classify_fn(fn: Any, depth: int, nr: int = 0) -> str:
    fn, nr = _through(fn, nr)
    if fn is None or depth > _MAX_DEPTH:
        return UNKNOWN
    name = type(fn).__name__
    reduction = getattr(fn, _REDUCTION_ATTR, None)
    if isinstance(reduction, int):  # loss nodes (nll_loss, mse_loss, binary_cross_entropy, kl_div, ...)
        return {1: MEAN, 2: SUM}.get(reduction, UNKNOWN)
    if name == "MeanBackward0":
        return MEAN
    if name == "SumBackward0":
        return SUM
    if name in _SCALE:
        if not _constant_other(fn):
            return UNKNOWN
        (branch, branch_nr), = _edges(fn)
        inner = _classify_fn(branch, depth + 1, branch_nr)
        if inner == SUM and name.startswith("Div"):
            return UNKNOWN  # sum / x: a local mean or a global normalisation, memrt cannot tell which
        return inner
    if name in _ADD:
        kinds = {_classify_fn(f, depth + 1, n) for f, n in _edges(fn)}
        return kinds.pop() if len(kinds) == 1 else UNKNOWN
    return UNKNOWN


def classify_loss(tensors: Any) -> str:
    """``mean`` / ``sum`` / ``unknown`` for the first argument of ``torch.autograd.backward``."""
    import torch

    if isinstance(tensors, (tuple, list)):
        if len(tensors) != 1:
            return UNKNOWN
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
        return UNKNOWN
    return _classify_fn(tensors.grad_fn, 0, tensors.output_nr)


def describe_loss(tensors: Any, depth: int = 4) -> str:
    """The first autograd nodes under the root, for messages: ``DivBackward0 <- NllLossBackward0(sum)``."""
    if isinstance(tensors, (tuple, list)):
        tensors = tensors[0] if len(tensors) == 1 else None
    fn, nr = _through(getattr(tensors, "grad_fn", None), getattr(tensors, "output_nr", 0))
    names = []
    while fn is not None and len(names) < depth:
        reduction = getattr(fn, _REDUCTION_ATTR, None)
        names.append(type(fn).__name__ + (f"({ {0: 'none', 1: 'mean', 2: 'sum'}.get(reduction, reduction)})"
                                          if isinstance(reduction, int) else ""))
        edges = _edges(fn)
        fn, nr = _through(*edges[0]) if len(edges) == 1 else (None, 0)
    return " <- ".join(names) or "no autograd graph"
