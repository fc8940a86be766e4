"""Units: the submodules whose activations the planner keeps, recomputes or offloads.

Default: the repeated blocks of the model, i.e. the children of every ``ModuleList``/``Sequential``
whose children (two or more) all have the same class (outermost such containers; the model itself
counts when it is one). When each of those children holds repeated blocks of its own (the stages of a
ConvNeXt or ResNet, each a run of layers), the inner blocks are the units: finer units give the planner
more to choose from and recompute less at once. A model without any: its direct children. Override with
class names (``units=["Block"]``): the outermost submodules of those classes.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch.nn as nn

__all__ = ["expect_module", "find_units", "structure_key"]


def expect_module(api: str, obj: object) -> nn.Module:
    """``obj`` if it is a ``torch.nn.Module``, else a TypeError that names ``api`` and what it got."""
    if not isinstance(obj, nn.Module):
        raise TypeError(f"{api} expects the torch.nn.Module memrt plans (the model passed to memrt.auto or "
                        f"memrt.apply), got {type(obj).__name__}: {obj!r:.80}")
    return obj


def _repeated(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    kids = list(module.children())
    return len(kids) >= 2 and len({type(k) for k in kids}) == 1


def find_units(model: nn.Module, unit_classes: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, module)]`` in registration order (see module docstring)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def add(name: str, m: nn.Module) -> None:
        if id(m) not in seen:
            seen.add(id(m))
            out.append((name, m))

    if unit_classes:
        wanted = set(unit_classes)

        def walk_cls(prefix: str, m: nn.Module) -> None:
            for cname, child in m.named_children():
                name = f"{prefix}{cname}"
                inner = getattr(child, "_orig_mod", child)  # torch.compile's wrapper is the unit (its call)
                if any(type(x).__name__ in wanted or type(x).__qualname__ in wanted for x in (child, inner)):
                    add(name, child)
                else:
                    walk_cls(name + ".", child)

        walk_cls("", model)
        if not out:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"units={list(unit_classes)!r} matches no submodule of {type(model).__name__}; "
                             f"its module classes are: {', '.join(found)}")
        return out

    def walk(prefix: str, m: nn.Module) -> None:
        if _repeated(m):
            kids = list(m.named_children())
            nested = all(any(_repeated(x) for x in child.modules()) for _, child in kids)
            for cname, child in kids:
                if nested:
                    walk(f"{prefix}{cname}.", child)
                else:
                    add(f"{prefix}{cname}", child)
            return
        for cname, child in m.named_children():
            walk(f"{prefix}{cname}.", child)

    walk("", model)
    if not out:
        for cname, child in model.named_children():
            add(cname, child)
    if not out:
        raise ValueError(f"{type(model).__name__} has no submodules to plan over; pass units=[class names] "
                         "or apply memrt to a model made of submodules")
    return out


def structure_key(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> str:
    """A digest of the module tree (names, classes, parameter/buffer shapes and dtypes) and the units."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__};".encode())
        for pname, p in m._parameters.items():
            if p is not None:
                h.update(f"p{pname}{tuple(p.shape)}{p.dtype};".encode())
        for bname, b in m._buffers.items():
            if b is not None:
                h.update(f"b{bname}{tuple(b.shape)}{b.dtype};".encode())
    h.update(("units:" + ",".join(n for n, _ in units)).encode())
    return h.hexdigest()[:24]
