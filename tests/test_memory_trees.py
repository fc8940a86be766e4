"""memrt.memory.trees.tensor_leaves: the tensors tree_flatten finds, in its order, without cyclic garbage."""

from __future__ import annotations

import gc
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from memrt.memory.trees import tensor_leaves

Pair = namedtuple("Pair", "a b")


@dataclass
class NotANode:  # not registered with torch's pytree: a leaf, as tree_flatten has it
    x: torch.Tensor


def _cases():
    t = [torch.full((i + 1,), float(i)) for i in range(6)]
    p = torch.nn.Parameter(torch.ones(2))
    return [
        t[0], (t[0], t[1]), [t[0], (t[1], [t[2]])], {"b": t[1], "a": t[0]}, ((t[0], 3, None, "s"), {"k": [t[1], 2.0]}),
        Pair(t[0], (t[1], t[2])), OrderedDict(z=t[3], y=t[4]), (p, t[5]), NotANode(t[0]), (), {}, [None],
        ((t[0],), {"attention_mask": None, "labels": t[1]}),
    ]


def test_same_tensors_in_the_same_order_as_tree_flatten():
    for case in _cases():
        expected = [x for x in tree_flatten(case)[0] if isinstance(x, torch.Tensor)]
        got = tensor_leaves(case)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected)), case


def test_mappings_looked_into_when_asked():
    class Outputs(dict):  # a dict subclass torch does not register: tree_flatten's leaf
        pass

    t = torch.ones(1)
    assert tensor_leaves((Outputs(logits=t),)) == []
    assert tensor_leaves((Outputs(logits=t),), into_mappings=True)[0] is t


def test_no_cyclic_garbage_for_plain_structures():
    args = ((torch.ones(2), [torch.ones(3)]), {"mask": torch.ones(1)})
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            tensor_leaves(args)
        assert gc.collect() == 0  # tree_flatten's walk leaves about 4 objects in cycles per call
    finally:
        gc.enable()
