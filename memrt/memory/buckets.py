"""Shape buckets: one plan serves every input shape of a bucket.

When the input shapes of a model's training steps vary (dynamic padding: the sequence length changes
every step; a smaller last batch), memrt plans per bucket instead of per shape. Every dimension of every
input tensor is rounded up to the next power of two (:func:`bucket_dim`): lengths 257..512 share the
bucket 512. A bucket is profiled once, at the first shape seen in it, and its plan is made for the
bucket's largest shape: the profile's activation bytes are scaled by :func:`shape_scale` (the largest
ratio of a tensor's element count at the bucket's bound to its count at the profiled shape) with
:func:`scale_profile`. Activations grow at most linearly with an input's element count in the layers
memrt plans (attention through ``scaled_dot_product_attention`` included); what grows faster is caught
by certification, which measures a step again whenever a shape in the bucket exceeds every shape
measured in it so far, and re-plans with the overshoot held back.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from memrt.memory.profile import Profile
from memrt.memory.trees import tensor_leaves

__all__ = ["Shape", "bucket_dim", "bucket_shapes", "input_shapes", "grows", "scale_profile", "shape_scale",
           "signature_of", "widen"]

Shape = tuple[tuple[int, ...], str, str]
"""(dimensions, dtype, device) of one input tensor."""


def bucket_dim(n: int) -> int:
    """The bucket bound of a dimension of size ``n``: the next power of two (0 and 1 stay)."""
    if n <= 1:
        return n
    return 1 << (int(n) - 1).bit_length()


def input_shapes(args: Any, kwargs: Any) -> list[Shape]:
    """Shapes of the tensors among a forward's arguments, in argument order."""
    out: list[Shape] = []
    for t in tensor_leaves((args, kwargs)):
        out.append((tuple(int(d) for d in t.shape), str(t.dtype).replace("torch.", ""), str(t.device)))
    return out


def signature_of(shapes: Sequence[Shape]) -> str:
    """The signature string of a list of shapes: ``(dims):dtype:device`` per tensor, joined by ``|``."""
    return "|".join(f"{dims}:{dtype}:{device}" for dims, dtype, device in shapes)


def bucket_shapes(shapes: Sequence[Shape]) -> list[Shape]:
    """Every dimension rounded up to its bucket bound."""
    return [(tuple(bucket_dim(d) for d in dims), dtype, device) for dims, dtype, device in shapes]


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def shape_scale(profiled: Sequence[Shape], bound: Sequence[Shape]) -> float:
    """How much larger the bucket's bound is than the profiled shapes: the largest ratio of element
    counts over the input tensors (1.0 when the profiled shape is the bound)."""
    f = 1.0
    for (a, _, _), (b, _, _) in zip(profiled, bound):
        na, nb = _numel(a), _numel(b)
        if na > 0 and nb > na:
            f = max(f, nb / na)
    return f


def grows(shapes: Sequence[Shape], envelope: Sequence[Shape] | None) -> bool:
    """Whether some dimension of ``shapes`` exceeds the same dimension of ``envelope`` (None: nothing measured)."""
    if envelope is None:
        return True
    return any(d > e for (dims, _, _), (env, _, _) in zip(shapes, envelope) for d, e in zip(dims, env))


def widen(shapes: Sequence[Shape], envelope: Sequence[Shape] | None) -> list[Shape]:
    """The elementwise largest of ``shapes`` and ``envelope``."""
    if envelope is None:
        return list(shapes)
    return [(tuple(max(d, e) for d, e in zip(dims, env)), dtype, device)
            for (dims, dtype, device), (env, _, _) in zip(shapes, envelope)]


def scale_profile(profile: Profile, f: float) -> Profile:
    """``profile`` with its activation bytes scaled by ``f`` (its fixed bytes as they are).

    Unit figures (saved, input, transient bytes) are activations; figures that are live bytes at a
    point of the step (``forward_start_bytes``, ``backward_start_bytes``, forward and backward
    constraints) are scaled above the step's starting live bytes (parameters, inputs, optimizer state),
    which do not change with the input shape; the optimizer-phase constraint is left as it is. The
    backward figures also hold parameter gradients, which scaling overstates: the result errs on the
    safe side.
    """
    if f <= 1.0:
        return profile
    out = copy.deepcopy(profile)
    base = profile.start_live_bytes

    def act(n: int) -> int:
        return int(round(n * f))

    def live(n: int) -> int:
        return base + act(n - base) if n > base else n

    for u in out.units:
        u.saved_bytes = act(u.saved_bytes)
        u.input_bytes = act(u.input_bytes)
        u.saved_not_input_bytes = act(u.saved_not_input_bytes)
        u.shared_with_previous_bytes = act(u.shared_with_previous_bytes)
        u.forward_keep_transient_bytes = act(u.forward_keep_transient_bytes)
        u.forward_recompute_transient_bytes = act(u.forward_recompute_transient_bytes)
        u.backward_recompute_transient_bytes = act(u.backward_recompute_transient_bytes)
        u.backward_transient_bytes = act(u.backward_transient_bytes)
        u.forward_start_bytes = live(u.forward_start_bytes)
        u.backward_start_bytes = live(u.backward_start_bytes)
    for c in out.constraints:
        if c.shifted:
            c.bytes = live(c.bytes)
    out.peak_bytes = live(profile.peak_bytes)
    return out
