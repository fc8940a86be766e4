"""Where memrt.comm's own work runs on CUDA: the group's device, the threads' device, their stream, completion.

- :func:`group_device`: the device a group's collectives use: the current CUDA device for NCCL, the CPU
  for gloo and MPI (a probe or an object collective on the wrong one fails, or puts every rank on cuda:0).
- :func:`setup_device`: the CUDA device for memrt's set-up collectives (discovery's ``all_gather_object``,
  group warm-up, link probe) on NCCL: the collective's tensor device, else ``device_id``, else the
  current device when the script chose one, else the launcher's local rank (modulo the visible devices).
  :func:`on_device` makes it current for the duration only.
- :class:`DeviceSubmission`: a collective handed from the caller's thread to memrt's worker thread. On
  CUDA it captures the caller's stream at submission (an event), and the worker binds its thread to the
  tensor's device (``torch.cuda.set_device``), runs the algorithm on memrt's dedicated comm stream (not
  the legacy default stream) after waiting for that event, and returns only when the GPU work is done,
  so futures, ``CommRecord.seconds`` and the hang watchdog see completion, not the enqueue.
- :func:`bound`: a callable run on another helper thread (the inter-node plug) bound to the device and
  to the stream of the thread that hands it over.
- :func:`warm_groups`: create every communicator of memrt's groups once, in a fixed order, at set-up
  (NCCL creates communicators lazily at a group's first call; several created at once mid-backward is
  NCCL's documented deadlock pattern).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["group_device", "setup_device", "on_device", "comm_stream", "DeviceSubmission", "bound", "warm_groups",
           "is_nccl"]

logger = logging.getLogger(__name__)

_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def is_nccl(group: Any = None) -> bool:
    """Whether ``group`` (default: the world) runs on NCCL."""
    import torch.distributed as dist

    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - not initialised / not a torch group
        return False


def group_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take tensors on: the current CUDA device for NCCL, else the CPU."""
    if is_nccl(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup_device(device: Any = None, *, device_id: Any = None, local_rank: int | None = None) -> torch.device | None:
    """The CUDA device for memrt's set-up collectives on NCCL (None off NCCL or without CUDA).

    Order: ``device`` (a CUDA tensor's device), ``device_id`` (init_process_group's), the current device
    when it is not cuda:0 (the script called set_device), the launcher's local rank modulo the number
    of visible devices (``local_rank``, default: memrt.launcher's discovery), else the current device.
    """
    if not torch.cuda.is_available() or not is_nccl():
        return None
    for cand in (device, device_id):
        if cand is None:
            continue
        d = torch.device("cuda", cand) if isinstance(cand, int) else torch.device(cand)
        if d.type == "cuda":
            return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    current = torch.cuda.current_device()
    if current != 0:
        return torch.device("cuda", current)
    if local_rank is None:
        try:
            from memrt.launcher import discover_launch

            local_rank = discover_launch().local_rank
        except Exception:  # noqa: BLE001 - no launcher information: the current device
            local_rank = -1
    if local_rank is not None and local_rank >= 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cuda", current)


@contextlib.contextmanager
def on_device(device: torch.device | None) -> Iterator[None]:
    """``device`` is the current CUDA device inside the block only (nothing for None or a CPU device)."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def comm_stream(device: torch.device) -> Any:
    """memrt.comm's dedicated stream on ``device`` (one per device, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return stream


class DeviceSubmission:
    """A collective submitted to a worker thread: device, stream and completion on CUDA; nothing on CPU.

    Create it on the caller's thread (it records the caller's stream); call :meth:`run` on the worker.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device if tensor.is_cuda else None
        self.ready = None
        if self.device is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))

    def run(self, fn: Callable[[], Any]) -> Any:
        if self.device is None:
            return fn()
        torch.cuda.set_device(self.device)  # this worker thread's device (the default is cuda:0)
        stream = comm_stream(self.device)
        stream.wait_event(self.ready)  # the caller's queued work produced the tensor
        with torch.cuda.stream(stream):
            out = fn()
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # complete = the GPU work is done (the GIL is released while waiting)
        return out


def bound(fn: Callable[..., Any], device: torch.device | None) -> Callable[..., Any]:
    """``fn``, to run on another thread, bound to ``device`` and to the stream current on the calling thread
    now (so its kernels queue behind the work that produced its input). Identity off CUDA."""
    if device is None or device.type != "cuda":
        return fn
    stream = torch.cuda.current_stream(device)

    def run(*args: Any, **kw: Any) -> Any:
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            return fn(*args, **kw)

    return run


def ordered_tiers(groups: Any) -> list[Any]:
    """This rank's tiers in the global creation order (node groups first, then inter-node by segment)."""
    tiers = [groups.intra_rs, groups.intra_ag] + [groups.inter[s] for s in sorted(groups.inter)]
    seen, out = set(), []
    for t in tiers:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def warm_groups(groups: Any, device: torch.device | None) -> list[tuple[int, ...]]:
    """One small all-reduce per group this rank belongs to, one at a time, in the global creation order.

    Every rank walks the same total order and waits for each group before the next, so communicator
    creation cannot deadlock. Returns the member ranks of each group warmed, in order.
    """
    if groups is None:
        return []
    dev = device if device is not None and device.type == "cuda" else torch.device("cpu")
    warmed = []
    with on_device(device):
        for tier in ordered_tiers(groups):
            x = torch.zeros(1, device=dev)
            work = tier.all_reduce(x, "SUM")
            if work is not None:
                work.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            warmed.append(tuple(getattr(tier, "ranks", ())))
    logger.debug("warmed %d memrt.comm groups on %s", len(warmed), dev)
    return warmed
