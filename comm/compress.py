"""Compression of the slow (inter-node) hop: bf16 / fp16 casts and int8 with per-chunk scales.

Only :func:`compressed_all_reduce` and :func:`compressed_reduce_scatter` touch the wire; the intra-node
tier stays exact because ``hierarchical_all_reduce`` / ``hierarchical_reduce_scatter`` call them on the
inter-node hop only. Integer tensors and non-sum reductions are never compressed.

Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., "Error Feedback
Fixes SignSGD", ICML 2019): what compression dropped from a call site's tensor (its *residual*) is
kept per ``key`` (one gradient buffer: a DDP bucket) and added to the next tensor of that same key
before it is compressed, so over steps nothing is lost and training converges like the exact run.
Calls without a key (a metric, a loss average) get no error feedback: another tensor's residual must
never leak into them.

The codecs themselves (bits, special values, error bounds) are in :mod:`memrt.comm.codecs`; whether a call
is compressed, and with which codec (``compress=auto`` included), is decided by :mod:`memrt.comm.select`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Hashable

import torch

from memrt.comm.codecs import (BLOCK_ELEMENTS, CODECS, INT8_CHUNK_ELEMENTS, Codec, check_codec as _check, decode,
                               encode)
from memrt.comm.reduction import DONE

__all__ = ["CODECS", "COMPRESS_VALUES", "Codec", "ErrorFeedback", "FeedbackKey", "check_compress",
           "compressed_all_reduce", "compressed_reduce_scatter", "feedback_part", "get_error_feedback", "encode",
           "decode", "pipeline_chunk_bytes", "INT8_CHUNK_ELEMENTS", "BLOCK_ELEMENTS"]

logger = logging.getLogger(__name__)

COMPRESS_VALUES = ("none", "auto") + CODECS
"""What ``compress=`` / ``MEMRT_COMPRESS`` accept."""


def check_compress(value: str | None, setting: str = "MEMRT_COMPRESS") -> None:
    """Raise ValueError naming ``setting`` unless ``value`` is None or one of :data:`COMPRESS_VALUES`."""
    if value is not None and value not in COMPRESS_VALUES:
        raise ValueError(f"{setting}={value!r} is not valid: expected one of {'|'.join(COMPRESS_VALUES)}")


@dataclass(frozen=True, slots=True)
class FeedbackKey:
    """Where a residual belongs: the gradient it compensates (``owner``) and the part of it (``part``).

    ``owner`` names one gradient buffer, e.g. ``("ddp", hook-id, bucket index)``; ``part`` tells apart
    the pieces of it that are compressed separately (pipeline chunk offset and length, the stage of
    the all-to-all path). :meth:`ErrorFeedback.claim` drops every part of an owner at once.
    """

    owner: Hashable
    part: tuple = ()

    def sub(self, *part: Hashable) -> "FeedbackKey":
        return FeedbackKey(owner=self.owner, part=self.part + part)


def _sub(key: Hashable, *part: Hashable) -> Hashable:
    return key.sub(*part) if isinstance(key, FeedbackKey) else (key, *part)


def feedback_part(key: Hashable, offset: int, numel: int) -> Hashable:
    """The key of elements ``offset .. offset + numel`` of the buffer ``key`` (a pipeline chunk)."""
    return _sub(key, offset, numel)


class ErrorFeedback:
    """Residuals per key: float32 buffers, zero at first use, updated in place by :func:`encode`.

    A residual is only ever added to the tensor of its own key: a caller that reduces one gradient
    buffer step after step (a DDP bucket) gives it a key of its own, and :meth:`claim` states what that
    buffer holds (DDP rebuilds its buckets after the first step: another layout, other residuals).
    """

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._layouts: dict[Hashable, Hashable] = {}
        self._lock = threading.Lock()

    def claim(self, owner: Hashable, layout: Hashable) -> None:
        """``owner``'s buffer now holds ``layout`` (e.g. its parameters): residuals of another layout are dropped."""
        with self._lock:
            if self._layouts.get(owner, layout) != layout:
                dropped = [k for k in self._residuals if isinstance(k, FeedbackKey) and k.owner == owner]
                for k in dropped:
                    del self._residuals[k]
                logger.debug("error feedback of %r: layout changed, %d residual(s) dropped", owner, len(dropped))
            self._layouts[owner] = layout

    def buffer(self, key: Hashable, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The residual of ``key`` for a tensor of ``numel`` elements (a new zero buffer if the size changed)."""
        with self._lock:
            r = self._residuals.get(key)
            if r is None or r.numel() != numel or r.device != torch.device(device):
                if r is not None:
                    logger.warning("error-feedback residual of key %r had %d elements, the tensor has %d: residual "
                                   "dropped (give each gradient buffer its own key)", key, r.numel(), numel)
                r = self._residuals[key] = torch.zeros(numel, device=device)
            return r

    def residual(self, key: Hashable) -> torch.Tensor | None:
        with self._lock:
            return self._residuals.get(key)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._residuals)

    def clear(self) -> None:
        with self._lock:
            self._residuals.clear()
            self._layouts.clear()

    def __len__(self) -> int:
        return len(self._residuals)


_EF = ErrorFeedback()


def get_error_feedback() -> ErrorFeedback:
    """The process-wide residual store used by :func:`compressed_all_reduce`."""
    return _EF


def _is_sum(op) -> bool:
    import torch.distributed as dist

    return op is None or op == dist.ReduceOp.SUM


def compressed_all_reduce(shard: torch.Tensor, group=None, codec: str = "int8", key: Hashable = None, *,
                          op=None, error_feedback: ErrorFeedback | None = None, async_op: bool = False):
    """Sum-all-reduce ``shard`` in place across ``group`` with the payload compressed by ``codec``.

    Every rank ends with identical values (all decode the same bytes and sum them in rank order).
    With two ranks the compressed payloads are all-gathered (one compression per call, pipelined in
    pieces); with more, a compressed reduce-scatter (all-to-all) is followed by a compressed all-gather
    of the reduced chunk (both stages with error feedback). Integer tensors and ops other than SUM go
    exact. ``key=None`` turns error feedback off for this call.

    Returns ``shard``; with ``async_op=True`` returns a handle whose ``wait()`` finishes the call (two
    ranks: the payload is encoded and on the wire when this returns, and ``wait()`` decodes the peer's
    payload into ``shard``), so the caller can encode the next tensor while this one is in flight.
    """
    import torch.distributed as dist

    _check(codec)
    if not shard.is_floating_point() or not _is_sum(op) or shard.numel() == 0:
        work = dist.all_reduce(shard, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=async_op)
        return work if async_op else shard
    ef = _EF if error_feedback is None else error_feedback
    m = dist.get_world_size(group)
    if m == 1:
        return DONE if async_op else shard
    flat = shard.reshape(-1)
    n = flat.numel()
    if m == 2:
        pending = _PairExchange(shard, flat, group, codec, None if key is None else ef.buffer(key, n, flat.device))
        if async_op:
            return pending
        pending.wait()
        return shard
    out = _two_phase(flat, group, codec, key, ef, m)
    shard.copy_(out.view(shard.shape))
    return DONE if async_op else shard


PIPELINE_CHUNK_BYTES = {"bf16": 4 << 20, "fp16": 4 << 20, "int8": 8 << 20}
"""Chunk of the hierarchical pipeline (input bytes) per codec. int8 puts a quarter of a chunk's bytes on
the slow link, so the fixed costs of a chunk (two intra-node barriers, three operation launches) weigh
twice what they do for bf16: twice the chunk halves them (measured on the emulated 2x2 cluster at
1 Gbit/s, 64 MiB: int8 4.5-5.2x over gloo with 8 MiB chunks, 3.9-4.5x with 4 MiB; bf16 best at 4 MiB)."""


def pipeline_chunk_bytes(codec: str, nbytes: int) -> int:
    """Chunk size for a compressed hierarchical all-reduce of ``nbytes`` (at least 8 chunks when it can)."""
    from memrt.comm.hierarchical import auto_chunk_bytes

    _check(codec)
    return auto_chunk_bytes(nbytes, PIPELINE_CHUNK_BYTES[codec])


PIPELINE_PIECE_ELEMENTS = 1 << 20
"""Elements per piece of the two-rank path: piece k+1 is encoded while piece k is on the wire."""


class _PairExchange:
    """Two ranks: encode my piece (its decoded value goes straight to ``out``), all-gather it
    asynchronously, and add the peer's decoded piece. a + b == b + a in IEEE arithmetic, so both ranks
    end bitwise equal. Pieces are pipelined: encoding overlaps the previous piece's transfer; every
    piece is on the wire when the constructor returns, :meth:`wait` decodes and writes ``shard``."""

    def __init__(self, shard: torch.Tensor, flat: torch.Tensor, group, codec: str,
                 residual: torch.Tensor | None) -> None:
        import torch.distributed as dist

        self.shard, self.codec, self.done = shard, codec, False
        n = flat.numel()
        self.me = dist.get_rank(group)
        # the decoded values go to the shard itself when it is float32 and contiguous (no copy at the end)
        self.direct = flat.dtype == torch.float32 and flat.data_ptr() == shard.data_ptr() and shard.is_contiguous()
        self.out = flat if self.direct else torch.empty(n, device=flat.device)
        self.pending: list = []
        for s in range(0, n, PIPELINE_PIECE_ELEMENTS):
            e = min(n, s + PIPELINE_PIECE_ELEMENTS)
            payload = encode(flat[s:e], codec, residual=None if residual is None else residual[s:e],
                             sent_out=self.out[s:e])
            bufs = [torch.empty_like(payload) for _ in range(2)]
            self.pending.append((dist.all_gather(bufs, payload, group=group, async_op=True), bufs, s, e))

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.done = True
        for work, bufs, s, e in self.pending:
            work.wait()
            decode(bufs[1 - self.me], self.codec, e - s, out=self.out[s:e], accumulate=True)
        self.pending.clear()
        if not self.direct:
            self.shard.copy_(self.out.view(self.shard.shape))
        return True


def _two_phase(flat, group, codec, key, ef, m):
    import torch.distributed as dist

    n = flat.numel()
    per = -(-n // m)
    x = flat.float()
    if per * m != n:
        x = torch.nn.functional.pad(x, (0, per * m - n))
    res = ef.buffer(key, per * m, x.device) if key is not None else None
    payloads = [encode(x[i * per:(i + 1) * per], codec, residual=None if res is None else res[i * per:(i + 1) * per])
                for i in range(m)]
    send = torch.cat(payloads)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    wire = payloads[0].numel()
    reduced = decode(recv[:wire], codec, per)
    for r in range(1, m):
        decode(recv[r * wire:(r + 1) * wire], codec, per, out=reduced, accumulate=True)
    me = dist.get_rank(group)
    res2 = ef.buffer(_sub(key, "reduced", me), per, x.device) if key is not None else None
    payload = encode(reduced, codec, residual=res2)
    gathered = [torch.empty_like(payload) for _ in range(m)]
    dist.all_gather(gathered, payload, group=group)
    out = torch.empty(per * m, device=x.device)
    for i, g in enumerate(gathered):
        decode(g, codec, per, out=out[i * per:(i + 1) * per])
    return out[:n]


def compressed_reduce_scatter(tier, blocks: torch.Tensor, out: torch.Tensor, codec: str, key: Hashable = None, *,
                              error_feedback: ErrorFeedback | None = None):
    """Sum-reduce-scatter across ``tier`` (one member per node, in node order) with the payload compressed.

    ``blocks`` holds ``tier.size`` blocks of ``out.numel()`` elements (block i goes to member i). Each block
    for another member is encoded (with error feedback under ``key``, one residual per destination) and
    exchanged in one all-to-all; this member's own block never leaves the rank and is added exact. Returns a
    handle whose ``wait()`` writes into ``out`` the sum over members in member order (decoded float32 sums,
    cast to ``out``'s dtype): inf and NaN in any input reach the same positions of the result.
    """
    ef = _EF if error_feedback is None else error_feedback
    m, me, w = tier.size, tier.rank, out.numel()
    wire = Codec(codec).wire_bytes(w)
    flat = blocks.reshape(-1)
    payloads = []
    for i in range(m):
        if i == me:
            continue
        res = None if key is None else ef.buffer(_sub(key, "to", i), w, flat.device)
        payloads.append(encode(flat[i * w:(i + 1) * w], codec, residual=res))
    send = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=flat.device)
    recv = torch.empty(wire * (m - 1), dtype=torch.uint8, device=flat.device)
    splits = [0 if i == me else wire for i in range(m)]
    work = tier.all_to_all(recv, send, splits, splits)
    return _ScatterSum(work, recv, flat[me * w:(me + 1) * w], out, codec, me, m)


class _ScatterSum:
    """The decode-and-sum half of :func:`compressed_reduce_scatter`."""

    def __init__(self, work, recv: torch.Tensor, own: torch.Tensor, out: torch.Tensor, codec: str, me: int,
                 m: int) -> None:
        self.work, self.recv, self.own, self.out, self.codec, self.me, self.m = work, recv, own, out, codec, me, m

    def wait(self, timeout=None) -> bool:
        if self.work is None:
            return True
        self.work.wait()
        self.work = None
        w = self.out.numel()
        wire = self.recv.numel() // max(self.m - 1, 1)
        total = self.out if self.out.dtype == torch.float32 else torch.empty(w, device=self.out.device)
        slot = 0
        for i in range(self.m):  # member order: the same order of additions on every rank
            if i == self.me:
                if i == 0:
                    total.copy_(self.own)
                else:
                    total.add_(self.own)
                continue
            decode(self.recv[slot * wire:(slot + 1) * wire], self.codec, w, out=total, accumulate=i > 0)
            slot += 1
        if total is not self.out:
            self.out.copy_(total)
        return True
