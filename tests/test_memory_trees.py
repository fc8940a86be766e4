"""memrt.memory.trees.tensor_leaves: the tensors tree_flatten finds, in its order, without cyclic garbage."""

from __future__ import annotations

import gc
from collections import OrderedDict, defaultdict, deque, namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch.utils._pytree import register_pytree_node, tree_flatten

from memrt.memory.trees import tensor_leaves

Pair = namedtuple("Pair", "a b")


class Batch(Pair):  # a subclass of a named tuple, as datasets often define
    pass


class Record(tuple):  # a tuple with `_fields` that is not a named tuple: a leaf for torch's pytree
    _fields = ("a",)


@dataclass
class NotANode:  # not registered with torch's pytree: a leaf, as tree_flatten has it
    x: torch.Tensor


class Registered:  # registered like transformers' ModelOutput
    def __init__(self, **kw):
        self.kw = kw


register_pytree_node(Registered, lambda r: (list(r.kw.values()), list(r.kw)),
                     lambda values, keys: Registered(**dict(zip(keys, values))))


def _cases():
    t = [torch.full((i + 1,), float(i)) for i in range(6)]
    p = torch.nn.Parameter(torch.ones(2))
    d = defaultdict(list)
    d["x"].append(t[2])
    return [
        t[0], (t[0], t[1]), [t[0], (t[1], [t[2]])], {"b": t[1], "a": t[0]}, ((t[0], 3, None, "s"), {"k": [t[1], 2.0]}),
        Pair(t[0], (t[1], t[2])), Batch(t[3], t[4]), Record((t[0],)), OrderedDict(z=t[3], y=t[4]), (p, t[5]),
        NotANode(t[0]), (), {}, [None], d, deque([t[1], t[0]]), torch.max(torch.stack([t[0], t[0]]), 0),
        Registered(logits=t[1], hidden=(t[2], t[3])), torch.Size([2, 3]),
        ((t[0],), {"attention_mask": None, "labels": t[1]}),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: type(c).__name__)
def test_same_tensors_in_the_same_order_as_tree_flatten(case):
    expected = [x for x in tree_flatten(case)[0] if isinstance(x, torch.Tensor)]
    got = tensor_leaves(case)
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


def test_mappings_looked_into_when_asked():
    class Outputs(dict):  # a dict subclass torch does not register: tree_flatten's leaf
        pass

    t = torch.ones(1)
    assert tensor_leaves((Outputs(logits=t),)) == []
    assert tensor_leaves((Outputs(logits=t),), into_mappings=True)[0] is t


def test_no_cyclic_garbage():
    t = torch.ones(2)
    args = ((t, [t]), {"mask": t}, Pair(t, t), OrderedDict(a=t), Registered(logits=t))
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            tensor_leaves(args)
        assert gc.collect() == 0  # tree_flatten's walk leaves about 7 objects in cycles per call
    finally:
        gc.enable()
