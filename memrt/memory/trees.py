"""The tensors inside a forward's arguments or outputs, found without making garbage.

torch's ``tree_flatten`` builds a self-referencing closure on every call, a reference cycle that only the
garbage collector frees; called a few times per training step it adds collections to the user's job.
:func:`tensor_leaves` walks plain tuples, lists and dicts itself (the usual arguments and outputs) in the
order ``tree_flatten`` gives, and hands anything else that torch registers as a pytree node (named tuples,
transformers' ``ModelOutput``, dataclasses registered by libraries) to ``tree_flatten``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_leaves"]

_PLAIN = (tuple, list)


def tensor_leaves(obj: Any, *, into_mappings: bool = False) -> list[torch.Tensor]:
    """The tensors among ``obj``'s pytree leaves, in ``tree_flatten`` order. ``into_mappings``: also look
    inside leaves that are mappings (not registered as pytree nodes), e.g. a dict subclass of outputs."""
    out: list[torch.Tensor] = []
    _collect(obj, out, into_mappings)
    return out


def _collect(obj: Any, out: list[torch.Tensor], into_mappings: bool) -> None:
    kind = type(obj)
    if kind is torch.Tensor or isinstance(obj, torch.Tensor):
        out.append(obj)
    elif kind in _PLAIN:
        for item in obj:
            _collect(item, out, into_mappings)
    elif kind is dict:
        for item in obj.values():
            _collect(item, out, into_mappings)
    elif obj is None or kind in (int, float, bool, str):
        return
    else:
        from collections.abc import Mapping

        from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

        if kind in SUPPORTED_NODES or _is_namedtuple(obj):
            for leaf in tree_flatten(obj)[0]:
                _collect(leaf, out, into_mappings)
        elif into_mappings and isinstance(obj, Mapping):
            for item in list(obj.values()):
                _collect(item, out, into_mappings)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")
