"""Shared-memory intra-node tier for CPU tensors: copies through /dev/shm instead of loopback TCP.

Each member of a node owns two slabs (double buffering by operation parity) mapped by every member
(``torch.from_file(..., shared=True)``); files are unlinked as soon as everyone mapped them, so
nothing is left behind even after a crash. An operation is: write my input into my slab, one
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
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from memrt.comm.tiers import DONE, combine, combine_

__all__ = ["ShmTier", "shm_available"]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmTier:
    """The ranks of one node, exchanging through shared memory; ``handle`` is the gloo group of barriers."""

    def __init__(self, pg: Any, ranks: Sequence[int], my_rank: int) -> None:
        import torch.distributed as dist

        self.handle = pg
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_rank)
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=self.ranks[0], group=pg)
        self._token = token[0]
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
        names = [[SHM_DIR / f"memrt-{self._token}-{m}-{self._gen}-{p}" for m in range(self.size)] for p in range(2)]
        mine = []
        for p in range(2):
            path = names[p][self.rank]
            mine.append(torch.from_file(str(path), shared=True, size=cap, dtype=torch.uint8))
        self._barrier()  # every slab exists
        bufs: list[list[torch.Tensor]] = [[], []]
        try:
            for p in range(2):
                for m in range(self.size):
                    bufs[p].append(mine[p] if m == self.rank else
                                   torch.from_file(str(names[p][m]), shared=True, size=cap, dtype=torch.uint8))
        finally:
            self._barrier()  # every slab mapped by everyone: the names can go
            for p in range(2):
                names[p][self.rank].unlink(missing_ok=True)
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
