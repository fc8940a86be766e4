"""Shared-memory intra-node tier for CPU tensors: copies through /dev/shm instead of loopback TCP.

Each member of a node owns two slabs (double buffering by operation parity) mapped by every member
(``torch.from_file(..., shared=True)``); files are unlinked as soon as everyone mapped them, so a crash
after that leaves nothing behind. Slabs hold gradients in clear: each is created with mode 0600 (not
under the process umask) and ``O_EXCL``, named ``memrt-shm-<host>-<pid>-<token>-...`` after its creator,
so that a slab of a process that died before unlinking it (killed while slabs grew) is removed by the
survivors of that growth and, failing that, by the next memrt process on the host whose creator is gone. An operation is: write my input into my slab, one
barrier on a small gloo group, read what I need from the peers' slabs. One barrier per operation is
enough: a member writes slab ``p`` again only two operations later, after a barrier that every
member entered only once done reading it.

Used automatically for CPU tensors when every rank of a node runs on the same host (discovery, or a
MEMRT_TOPOLOGY grouping that matches hosts) and the default backend includes gloo. Requirement of
``all_to_all``: every member splits its input the same way (true for memrt's algorithms).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from memrt.comm.reduction import DONE, combine, combine_
from memrt.launcher import pid_alive

__all__ = ["ShmTier", "shm_available", "sweep_stale_slabs"]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


_PREFIX = "memrt-shm-"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def sweep_stale_slabs(directory: Path = SHM_DIR) -> int:
    """Remove this host's slabs whose creating process is gone; returns how many (other hosts' are kept)."""
    prefix = f"{_PREFIX}{_host()}-"
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            os.unlink(directory / name)
            removed += 1
        except OSError:  # another user's file, or removed meanwhile
            pass
    if removed:
        logger.info("removed %d shared-memory slab(s) of dead processes from %s", removed, directory)
    return removed


def _create_private(path: Path, nbytes: int) -> torch.Tensor:
    """A new file of ``nbytes`` with mode 0600 whatever the umask, mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class ShmTier:
    """The ranks of one node, exchanging through shared memory; ``handle`` is the gloo group of barriers."""

    def __init__(self, pg: Any, ranks: Sequence[int], my_rank: int) -> None:
        import torch.distributed as dist

        self.handle = pg
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_rank)
        if self.rank == 0:
            sweep_stale_slabs()
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=self.ranks[0], group=pg)
        self._token = token[0]
        pids: list[Any] = [None] * self.size
        dist.all_gather_object(pids, os.getpid(), group=pg)
        host = _host()
        self._stems = [f"{_PREFIX}{host}-{pid}-{self._token}-{m}" for m, pid in enumerate(pids)]
        self._cap = 0
        self._gen = 0
        self._ops = 0
        self._bufs: list[list[torch.Tensor]] = [[], []]

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.handle)

    def _ensure(self, nbytes: int) -> None:
        """Grow the slabs to ``nbytes`` (every member asks for the same size at the same operation)."""
        if nbytes <= self._cap:
            return
        cap = max(nbytes, 2 * self._cap, 1 << 20)
        cap = -(-cap // 4096) * 4096
        self._gen += 1
        names = [[SHM_DIR / f"{self._stems[m]}-{self._gen}-{p}" for m in range(self.size)] for p in range(2)]
        bufs: list[list[torch.Tensor]] = [[], []]
        ok = False
        try:
            mine = [_create_private(names[p][self.rank], cap) for p in range(2)]
            self._barrier()  # every slab exists
            for p in range(2):
                for m in range(self.size):
                    bufs[p].append(mine[p] if m == self.rank else
                                   torch.from_file(str(names[p][m]), shared=True, size=cap, dtype=torch.uint8))
            self._barrier()  # every slab mapped by everyone: the names can go
            ok = True
        finally:
            # normally each member unlinks its own; after a failure (a member died mid-growth) the survivors
            # remove every member's, the dead one's included
            for p in range(2):
                for m in ((self.rank,) if ok else range(self.size)):
                    names[p][m].unlink(missing_ok=True)
        self._bufs, self._cap = bufs, cap

    def _slab(self, t: torch.Tensor, need_bytes: int | None = None, skip: tuple[int, int] = (0, 0)) -> int:
        """Write ``t`` into my slab and wait for everyone; ``need_bytes`` must be equal on every member.
        ``skip=(offset, count)``: elements nobody else reads, left unwritten."""
        nbytes = t.numel() * t.element_size()
        self._ensure(nbytes if need_bytes is None else max(need_bytes, nbytes))
        p = self._ops % 2
        self._ops += 1
        if nbytes:
            dst, src = self._bufs[p][self.rank][:nbytes].view(t.dtype), t.reshape(-1)
            lo, hi = skip[0], skip[0] + skip[1]
            if hi > lo:
                dst[:lo].copy_(src[:lo])
                dst[hi:].copy_(src[hi:])
            else:
                dst.copy_(src)
        self._barrier()
        return p

    def _peer(self, p: int, m: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        esize = torch.empty((), dtype=dtype).element_size()
        return self._bufs[p][m][:numel * esize].view(dtype)

    def all_to_all(self, out, inp, out_splits, in_splits):
        p = self._slab(inp)
        off, n = sum(in_splits[:self.rank]), in_splits[self.rank]
        if n:
            for m in range(self.size):
                out[m * n:(m + 1) * n].copy_(self._peer(p, m, inp.dtype, inp.numel())[off:off + n])
        return DONE

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int], op: str):
        """``out`` = my piece of every member's ``inp`` reduced in member order (no intermediate copy).

        Members 0 and 1 read their own piece from ``inp`` (it is consumed by the first combine, before
        ``out``, which may alias it, is written), so they leave it out of the slab."""
        off, n = sum(splits[:self.rank]), splits[self.rank]
        own_first = self.rank < 2 and self.size > 1
        p = self._slab(inp, skip=(off, n) if own_first else (0, 0))
        if n:
            mine = inp.reshape(-1)[off:off + n]

            def piece(m: int) -> torch.Tensor:
                if m == self.rank and own_first:
                    return mine
                return self._peer(p, m, inp.dtype, inp.numel())[off:off + n]

            if self.size == 1:
                if out.data_ptr() != mine.data_ptr():
                    out.copy_(mine)
                return DONE
            combine(piece(0), piece(1), op, out=out)
            for m in range(2, self.size):
                combine_(out, piece(m), op)
        return DONE

    def all_gather(self, out, inp):
        p = self._slab(inp)
        w = inp.numel()
        for m in range(self.size):
            out[m * w:(m + 1) * w].copy_(self._peer(p, m, inp.dtype, w))
        return DONE

    def all_gather_into_views(self, views: Sequence[torch.Tensor], inp: torch.Tensor):
        """views[m] <- member m's input (first views[m].numel() elements); my own view is left alone."""
        need = max(v.numel() for v in views) * inp.element_size()
        p = self._slab(inp, need)
        for m, v in enumerate(views):
            if m != self.rank and v.numel():
                v.copy_(self._peer(p, m, inp.dtype, v.numel()))
        return DONE

    def all_reduce(self, t, op):
        p = self._slab(t)
        flat = t.view(-1)
        flat.copy_(self._peer(p, 0, t.dtype, t.numel()))
        for m in range(1, self.size):
            combine_(flat, self._peer(p, m, t.dtype, t.numel()), op)
        return DONE

    def broadcast(self, t, root):
        need = t.numel() * t.element_size()
        if self.rank == root:
            self._slab(t, need)
        else:
            p = self._slab(t.reshape(-1)[:0], need)
            t.view(-1).copy_(self._peer(p, root, t.dtype, t.numel()))
        return DONE
