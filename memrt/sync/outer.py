"""The outer optimizer of ``MEMRT_SYNC=diloco`` and the state it keeps per parameter fragment.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105) treats the nodes' averaged parameter change since the last outer step as a gradient
(the *outer gradient* or pseudo-gradient) and applies it to the parameters of the last outer step (the
*anchor*) with Nesterov momentum SGD; the paper's defaults are outer learning rate 0.7, momentum 0.9.

Everything here is plain tensor arithmetic on one fragment's flat float32 buffers: no collective, no
process group. :mod:`memrt.sync.diloco` owns the schedule and the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Fragment", "OuterSGD", "fragment_offsets", "make_fragment", "split_parameters"]


@dataclass(kw_only=True, slots=True)
class OuterSGD:
    """Nesterov momentum SGD on the outer gradient, as ``torch.optim.SGD(nesterov=True)`` computes it.

    ``buf <- momentum * buf + delta``; ``update = delta + momentum * buf`` (Nesterov) or ``buf`` (heavy ball);
    ``params <- anchor - lr * update``. With ``momentum=0`` and ``lr=1`` the new parameters are exactly
    ``anchor - delta``: the nodes' weighted parameter average.
    """

    lr: float = 0.7
    """Outer learning rate (DiLoCo's default 0.7); 1.0 with momentum 0 is plain parameter averaging."""
    momentum: float = 0.9
    """Outer momentum coefficient in [0, 1) (DiLoCo's default 0.9); 0 keeps no momentum buffer."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo's choice); False is heavy-ball momentum."""

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"outer_lr={self.lr!r} is not valid: expected a number > 0 (DiLoCo's default 0.7)")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ValueError(f"outer_momentum={self.momentum!r} is not valid: expected a number in [0, 1) "
                             "(DiLoCo's default 0.9)")

    def step(self, anchor: torch.Tensor, buf: torch.Tensor | None, delta: torch.Tensor) -> None:
        """In place: ``anchor`` becomes the new parameters, ``buf`` the new momentum; ``delta`` is scratch."""
        if self.momentum > 0:
            if buf is None:
                raise ValueError("outer momentum > 0 needs a momentum buffer")
            buf.mul_(self.momentum).add_(delta)
            if self.nesterov:
                delta.add_(buf, alpha=self.momentum)
            else:
                delta.copy_(buf)
        anchor.add_(delta, alpha=-self.lr)


def _host_buffer(numel: int, pinned: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32, pin_memory=pinned)


@dataclass(kw_only=True, slots=True, eq=False)
class Fragment:
    """A group of parameters that takes its outer steps together, and its outer state (host memory).

    A fragment's outer steps happen after the inner steps ``t`` with ``(t - offset) % every == 0``: streaming
    DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv:2501.18512) gives
    each fragment its own offset so that the exchanges spread over the round; one fragment at offset 0 is the
    all-at-once schedule.
    """

    params: tuple[torch.nn.Parameter, ...]
    """The parameters, in the order of the flat buffers."""
    offset: int = 0
    """Schedule offset in inner steps (0: outer steps after inner steps every, 2 * every, ...)."""
    anchor: torch.Tensor
    """float32, flat, host (pinned when the parameters are on CUDA): the parameters at the last outer step."""
    momentum: torch.Tensor | None
    """float32, flat, host: the outer momentum buffer (None when the outer momentum is 0)."""
    staging: torch.Tensor | None = None
    """float32, flat, pinned host: where the reduced outer gradient lands from the device (CUDA only)."""
    steps: int = 0
    """Inner steps since this fragment's last outer step."""
    samples: float = 0.0
    """Samples this rank counted since the last outer step (``DiLoCo.count_samples``)."""
    counted: bool = False
    """True once samples were counted this round: the weight is then ``samples``, else ``steps``."""
    numel: int = field(init=False)
    """Elements in the fragment."""

    def __post_init__(self) -> None:
        self.numel = sum(p.numel() for p in self.params)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory this fragment's outer state holds (anchor, momentum, staging)."""
        return sum(t.numel() * t.element_size() for t in (self.anchor, self.momentum, self.staging) if t is not None)

    def flat(self) -> torch.Tensor:
        """The current parameters as one new float32 tensor on their device."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def write(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (any device) into the parameters, then make the anchor exactly what they hold."""
        offset = 0
        flat = flat.to(self.device, non_blocking=True)  # one host-to-device copy, not one per parameter
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                if p.dtype != torch.float32:  # the anchor is what the parameters hold after their rounding
                    self.anchor[offset:offset + n].copy_(p.reshape(-1))
                offset += n

    def reset_round(self) -> None:
        self.steps, self.samples, self.counted = 0, 0.0, False


def make_fragment(params: Sequence[torch.nn.Parameter], *, offset: int = 0, momentum: bool = True) -> Fragment:
    """A fragment over ``params`` whose anchor is their current values (host, pinned for CUDA parameters)."""
    params = tuple(params)
    if not params:
        raise ValueError("a fragment needs at least one parameter")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"the parameters of one fragment are on {len(devices)} devices ({sorted(map(str, devices))}): "
                         "expected one (a model replica per rank, as DDP has)")
    cuda = params[0].device.type == "cuda"
    numel = sum(p.numel() for p in params)
    anchor = _host_buffer(numel, cuda)
    frag = Fragment(params=params, offset=offset, anchor=anchor, momentum=_host_buffer(numel, cuda) if momentum else None,
                    staging=_host_buffer(numel, True) if cuda else None)
    anchor.copy_(frag.flat())
    return frag


def split_parameters(params: Sequence[torch.nn.Parameter], k: int) -> list[tuple[torch.nn.Parameter, ...]]:
    """``params`` (in their order) as ``k`` contiguous, non-empty groups of roughly equal element counts, no
    tensor split: cut ``i`` lies at the tensor boundary nearest ``i / k`` of the elements (ties: the earlier),
    leaving at least one tensor for each group after it."""
    params = tuple(params)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(params):
        raise ValueError(f"k={k!r} is not valid: expected a whole number of groups in [1, {len(params)}] "
                         "(one tensor at least per group)")
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p.numel())
    total, cuts = prefix[-1], [0]
    for i in range(1, k):
        lo, hi = cuts[-1] + 1, len(params) - (k - i)  # cut after tensor c-1: c in [lo, hi]
        cuts.append(min(range(lo, hi + 1), key=lambda c: abs(k * prefix[c] - i * total)))  # integers: exact
    cuts.append(len(params))
    return [params[a:b] for a, b in zip(cuts, cuts[1:])]


def fragment_offsets(k: int, every: int) -> list[int]:
    """Schedule offsets of ``k`` fragments spread over a round of ``every`` inner steps: ``round(i * every / k)``
    (Streaming DiLoCo's staggered schedule); distinct for ``k <= every``."""
    return [round(i * every / k) for i in range(k)]
