"""The tensors inside a forward's arguments or outputs, found without making garbage.

torch's ``tree_flatten`` builds a self-referencing closure on every call, a reference cycle that only the
garbage collector frees; called a few times per training step it adds collections to the user's job.
:func:`tensor_leaves` walks the same tree itself, one level at a time with the flatten function torch has
registered for each node type (tuples, lists, dicts, named tuples, ``OrderedDict``, ``torch.return_types``,
transformers' ``ModelOutput`` and anything else libraries register), so it finds the leaves ``tree_flatten``
finds, in its order, and leaves nothing behind for the collector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, _get_node_type

__all__ = ["tensor_leaves"]

_SCALARS = (int, float, bool, str, type(None))


def tensor_leaves(obj: Any, *, into_mappings: bool = False) -> list[torch.Tensor]:
    """The tensors among ``obj``'s pytree leaves, in ``tree_flatten`` order. ``into_mappings``: also look
    inside leaves that are mappings (not registered as pytree nodes), e.g. a dict subclass of outputs."""
    out: list[torch.Tensor] = []
    _collect(obj, out, into_mappings)
    return out


def _collect(obj: Any, out: list[torch.Tensor], into_mappings: bool) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    kind = type(obj)
    if kind in _SCALARS:
        return
    if kind is tuple or kind is list:  # the common case, without a flatten call
        children: Any = obj
    elif kind is dict:
        children = obj.values()
    else:
        node = SUPPORTED_NODES.get(_get_node_type(obj))
        if node is not None:
            children = node.flatten_fn(obj)[0]
        elif into_mappings and isinstance(obj, Mapping):
            children = list(obj.values())
        else:
            return  # a leaf that is not a tensor
    for child in children:
        _collect(child, out, into_mappings)
