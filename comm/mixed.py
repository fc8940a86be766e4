"""Mixed device kinds in one job: run each collective over a backend all its members share.

Ranks on CUDA and ranks on CPU (or on different accelerators) cannot meet in NCCL; gloo reaches every
rank through host memory. :func:`choose_backend` picks, for a group's device kinds, the device-native
backend when every member has the same kind and that backend is available (cuda -> nccl, xpu -> xccl,
hpu -> hccl, cpu -> gloo), else gloo with host staging on each member whose tensors do not live in host
memory (copy to host, collective, copy back). :class:`MixedComm` applies the choice to a group: it
learns the members' kinds (one all-gather, or the topology's ``device_kinds``), builds the process
group for the chosen backend once, and offers ``all_reduce`` / ``broadcast`` / ``all_gather_into_tensor``
and an async ``all_reduce_future`` for DDP comm hooks.

Tests force kinds through the internal variable ``MEMRT_FORCE_DEVICE_KIND``: either one kind for the
process (``cuda``) or per rank (``0=cuda,1=cpu``). On a CPU-only machine a forced ``cuda`` rank stages its
(CPU) tensors through a separate host buffer all the same, so the staging path runs and is counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from memrt.config import internal_setting

__all__ = ["BackendChoice", "MixedComm", "NATIVE_BACKEND", "choose_backend", "forced_device_kind",
           "gather_device_kinds", "local_device_kind"]

logger = logging.getLogger(__name__)

NATIVE_BACKEND = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}
"""Device kind -> torch.distributed backend that runs collectives on that device's memory."""
HOST_BACKEND = "gloo"
"""The backend every rank can reach (through host memory)."""


def forced_device_kind(rank: int | None = None, raw: str | None = None) -> str | None:
    """The kind ``MEMRT_FORCE_DEVICE_KIND`` imposes on ``rank`` (None when unset or rank not named)."""
    raw = internal_setting("MEMRT_FORCE_DEVICE_KIND") if raw is None else raw
    if not raw or not raw.strip():
        return None
    if "=" not in raw:
        return raw.strip().lower()
    for item in raw.split(","):
        r, _, kind = item.partition("=")
        try:
            if rank is not None and int(r) == rank:
                return kind.strip().lower()
        except ValueError:
            raise ValueError(f"MEMRT_FORCE_DEVICE_KIND={raw!r} is not valid: expected a kind (cuda) or "
                             "rank=kind pairs (0=cuda,1=cpu)") from None
    return None


def local_device_kind(device: Any = None, *, rank: int | None = None) -> str:
    """This rank's device kind: the forced one, else ``device``'s type, else cuda when available, else cpu."""
    forced = forced_device_kind(rank)
    if forced:
        return forced
    if device is not None:
        import torch

        return torch.device(device).type
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gather_device_kinds(group: Any = None, device: Any = None) -> tuple[str, ...]:
    """Every member's device kind, by group rank (one all_gather_object, on ``device`` when it is a CUDA one)."""
    import torch.distributed as dist

    import torch

    from memrt.comm.streams import on_device

    mine = local_device_kind(device, rank=dist.get_rank())
    out: list[Any] = [None] * dist.get_world_size(group)
    dev = torch.device(device) if device is not None else None
    with on_device(dev):  # an NCCL group's object collective runs on this rank's device, not cuda:0
        dist.all_gather_object(out, mine, group=group)
    return tuple(out)


@dataclass(kw_only=True, slots=True, frozen=True)
class BackendChoice:
    """The backend of one group's collectives and who stages through host memory."""

    backend: str
    """torch.distributed backend the collectives run on (nccl, gloo, ...)."""
    kinds: tuple[str, ...]
    """Device kind per member (group rank order)."""
    staged: tuple[bool, ...]
    """Per member: True when its tensors are copied to host memory and back around each collective."""
    reason: str
    """Why this backend (for tables and logs)."""

    def table(self) -> str:
        rows = [f"{'rank':>4}  {'kind':<6} {'backend':<7} staging"]
        rows += [f"{r:>4}  {k:<6} {self.backend:<7} {'host copy' if s else 'none'}"
                 for r, (k, s) in enumerate(zip(self.kinds, self.staged))]
        return "\n".join(rows + [f"({self.reason})"])


def _available(backend: str) -> bool:
    import torch.distributed as dist

    try:
        return bool(dist.is_backend_available(backend))
    except (AttributeError, RuntimeError):
        return backend == HOST_BACKEND


def choose_backend(kinds: Sequence[str], *, available: Sequence[str] | None = None) -> BackendChoice:
    """Device-native backend when all ``kinds`` agree and it is available; else gloo with host staging."""
    kinds = tuple(k.lower() for k in kinds)
    if not kinds:
        raise ValueError("kinds is empty: need one device kind per group member")

    def ok(backend: str) -> bool:
        return backend in available if available is not None else _available(backend)

    distinct = sorted(set(kinds))
    if len(distinct) == 1:
        native = NATIVE_BACKEND.get(distinct[0])
        if native and ok(native):
            return BackendChoice(backend=native, kinds=kinds, staged=(False,) * len(kinds),
                                 reason=f"all members on {distinct[0]}: native {native}")
        why = (f"{native} not available" if native else f"no collective backend for {distinct[0]}")
    else:
        why = f"mixed kinds {'+'.join(distinct)} share no device backend"
    if not ok(HOST_BACKEND):
        raise RuntimeError(f"{why} and gloo is unavailable: install a torch build with gloo")
    staged = tuple(k != "cpu" for k in kinds)
    return BackendChoice(backend=HOST_BACKEND, kinds=kinds, staged=staged,
                         reason=f"{why}: gloo, host staging on {sum(staged)} member(s)")


class MixedComm:
    """Collectives over ``group`` whose members may sit on different device kinds.

    Construction is collective (every rank of the job calls it at the same point: it may all-gather
    the kinds and create a process group). ``kinds`` skips the all-gather (e.g. the topology's
    ``device_kinds``); ``device`` is this rank's device when not forced.
    """

    def __init__(self, group: Any = None, *, kinds: Sequence[str] | None = None, device: Any = None,
                 available: Sequence[str] | None = None) -> None:
        import torch.distributed as dist

        self.parent = group
        self.rank = dist.get_rank(group)
        kinds = tuple(kinds) if kinds is not None else gather_device_kinds(group, device)
        self.choice = choose_backend(kinds, available=available)
        self.staging = self.choice.staged[self.rank]
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        if dist.get_backend(group) == self.choice.backend:
            self.group = group
        else:  # every rank of the job takes part in new_group, members or not
            self.group = dist.new_group(ranks, backend=self.choice.backend)
        self.staged_bytes = 0
        """Bytes this rank copied to host and back (each direction counted once)."""
        self.calls = 0
        logger.info("mixed comm: %s", self.choice.reason)

    # staging -------------------------------------------------------------------------------------------
    def _to_wire(self, tensor):
        if not self.staging:
            return tensor
        self.staged_bytes += tensor.numel() * tensor.element_size()
        return tensor.detach().to("cpu", copy=True)

    def _from_wire(self, tensor, wire):
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    # collectives ---------------------------------------------------------------------------------------
    def all_reduce(self, tensor, op: Any = None) -> Any:
        import torch.distributed as dist

        self.calls += 1
        wire = self._to_wire(tensor)
        dist.all_reduce(wire, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
        return self._from_wire(tensor, wire)

    def all_reduce_future(self, tensor, op: Any = None):
        """Async SUM (or ``op``) all-reduce; the future's value is ``tensor`` holding the result (DDP hooks)."""
        import torch.distributed as dist

        self.calls += 1
        wire = self._to_wire(tensor)
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM if op is None else op, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: self._from_wire(tensor, wire))

    def broadcast(self, tensor, src: int) -> Any:
        import torch.distributed as dist

        self.calls += 1
        wire = self._to_wire(tensor)
        dist.broadcast(wire, src=src, group=self.group)
        return self._from_wire(tensor, wire)

    def all_gather_into_tensor(self, output, tensor) -> Any:
        import torch.distributed as dist

        self.calls += 1
        wire_out, wire_in = self._to_wire(output), self._to_wire(tensor)
        if self.choice.backend == HOST_BACKEND:
            chunks = list(wire_out.chunk(dist.get_world_size(self.group)))
            dist.all_gather(chunks, wire_in, group=self.group)  # gloo has no all_gather_into_tensor
        else:
            dist.all_gather_into_tensor(wire_out, wire_in, group=self.group)
        return self._from_wire(output, wire_out)

    def table(self) -> str:
        return self.choice.table()
