"""Balanced shares of the job's own global batches, for DataLoaders built by unchanged scripts.

A data-parallel DataLoader is a *sharded* batch source: at step k rank r gets its k-th batch, and the
union over ranks is the step's global batch. memrt recognises two such sources when the DataLoader is
built (:func:`balanced_sampler_for`):

- ``DataLoader(ds, batch_size=b, sampler=DistributedSampler(...))`` (torchrun examples, most scripts), or
  ``batch_sampler=BatchSampler(DistributedSampler(...), b, drop_last)``: rank r's batch k is ``b``
  consecutive items of the sampler's stride-``W`` subsequence;
- accelerate's ``BatchSamplerShard`` (``Accelerator.prepare``, hence the HF Trainer): rank r's batch k is
  batch ``k*W + r`` of the shared batch sampler (``split_batches=False``) or slice r of batch k (``True``).

:class:`ShareSampler` replaces the source as the DataLoader's batch sampler. Per iteration it computes
every rank's stock batches with the source's own logic (no user-visible RNG: DistributedSampler shuffles
with a private generator seeded by ``seed + epoch``; accelerate's shared batch sampler is iterated once,
as stock does, and replayed to each rank's shard), concatenates the ranks' k-th batches in rank order into
global batch k — exactly the stock sample set of step k — and hands rank r a slice of it. While the shares
are the stock ones (before any decision, or when balancing does not pay) the slice IS rank r's stock
batch, index for index; the number of batches per iteration is always the stock one.
The explicit API's :class:`~memrt.balance.sampler.BalancedBatchSampler` is this sampler over one more
source (a seeded permutation cut into global batches) whose shares are read live from its ``SpeedBalancer``.

Shares change only at a position ``(iteration, batch index)`` that no rank has drawn yet (agreed in the
controller's exchange), so prefetching DataLoader workers never mix two share vectors in one global batch.
Each drawn batch carries its gradient factor (``n_r * W / B_k`` when balanced for a mean-reduced loss,
1.0 for stock slices); consumption is tracked where the training loop receives batches, so the comm hook
applies the factor of the batch that really was in this step's forward.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from memrt.balance.shares import decide_shares

if TYPE_CHECKING:
    from torch.utils.data import Dataset, DistributedSampler, Sampler

__all__ = ["BatchSource", "ShareSampler", "balanced_sampler_for", "unbalanced_reason", "note_consumed_inner"]

logger = logging.getLogger(__name__)


class BatchSource(Protocol):
    """Every rank's stock batches of one data-parallel batch source (what :class:`ShareSampler` re-splits)."""

    kind: str
    """For messages: what the source is."""
    rank: int
    world: int
    equal_chunks: bool
    """True: the ranks' k-th batches are re-split only when they have equal sizes (else stock)."""
    batch_size: int | None
    drop_last: bool

    @property
    def sampler(self) -> Any:
        """The script's sampler (``loader.sampler``, ``set_epoch`` callers reach it); None if none."""
        ...

    @property
    def wrapped(self) -> Any:
        """The object whose other attributes the share sampler passes through (None: none)."""
        ...

    def full_batch(self) -> int: ...
    def __len__(self) -> int: ...
    def per_rank_batches(self) -> list[list[list[int]]]: ...
    def set_epoch(self, epoch: int) -> None: ...


class _DistributedSource:
    """Stock batches of ``DataLoader(batch_size=b, sampler=DistributedSampler, drop_last=d)`` for every rank."""

    kind = "DistributedSampler"
    equal_chunks = True

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size: int | None = batch_size
        self.drop_last = drop_last
        self.world = int(sampler.num_replicas)
        self.rank = int(sampler.rank)

    @property
    def wrapped(self) -> Any:
        return self.sampler

    def full_batch(self) -> int:
        return self.batch_size * self.world

    def __len__(self) -> int:
        n = int(self.sampler.num_samples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _indices(self) -> list[int]:
        """The sampler's padded/truncated global order (what ``DistributedSampler.__iter__`` subsamples)."""
        s = self.sampler
        whole = copy.copy(s)  # the same shuffle code and seed, over one replica: the full permutation
        whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
        whole.num_samples = whole.total_size = len(s.dataset)
        indices = list(iter(whole))
        total = int(s.total_size)
        if not s.drop_last:
            pad = total - len(indices)
            if pad > 0:
                indices += (indices * -(-pad // len(indices)))[:pad]
        else:
            indices = indices[:total]
        return indices

    def per_rank_batches(self) -> list[list[list[int]]]:
        indices = self._indices()
        out = []
        for r in range(self.world):
            mine = indices[r::self.world]
            batches = [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            if self.drop_last and batches and len(batches[-1]) < self.batch_size:
                batches.pop()
            out.append(batches)
        return out

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class _Replay:
    """A batch sampler that yields a fixed list of batches (accelerate's shard logic runs over it)."""

    def __init__(self, batches: list[list[int]], like: Any) -> None:
        self._batches = batches
        self.batch_size = getattr(like, "batch_size", None)
        self.drop_last = getattr(like, "drop_last", False)
        self.sampler = getattr(like, "sampler", None)

    def __iter__(self):
        return iter([list(b) for b in self._batches])  # fresh lists: the shard's padding extends them in place

    def __len__(self) -> int:
        return len(self._batches)


class _AccelerateSource:
    """Stock batches of accelerate's ``BatchSamplerShard`` for every rank (one pass over the shared sampler)."""

    kind = "accelerate BatchSamplerShard"
    equal_chunks = True

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.world = int(shard.num_processes)
        self.rank = int(shard.process_index)
        self.batch_size: int | None = shard.batch_size
        self.drop_last = False

    @property
    def wrapped(self) -> Any:
        return self.shard

    @property
    def sampler(self) -> Any:
        """The shared sampler, read live (accelerate's ``set_sampler`` swaps it after construction)."""
        return getattr(self.shard.batch_sampler, "sampler", None)

    def full_batch(self) -> int:
        b = int(self.shard.batch_size)
        return b if self.shard.split_batches else b * self.world

    def __len__(self) -> int:
        return len(self.shard)

    def per_rank_batches(self) -> list[list[list[int]]]:
        replay = _Replay([list(b) for b in self.shard.batch_sampler], self.shard.batch_sampler)
        out = []
        for r in range(self.world):
            mine = copy.copy(self.shard)
            mine.batch_sampler, mine.process_index = replay, r
            out.append([list(b) for b in mine])
        return out

    def set_epoch(self, epoch: int) -> None:
        for target in (self.shard, self.shard.batch_sampler, self.sampler):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return


def unbalanced_reason(dataset: Dataset, sampler: Sampler | None, batch_sampler: Any,
                      batch_size: int | None) -> str | None:
    """Why a DataLoader built with these arguments stays as it is, or None when memrt can balance it."""
    from torch.utils.data import DistributedSampler, IterableDataset

    if isinstance(dataset, IterableDataset):
        return "an iterable dataset: memrt cannot re-split its batches"
    if batch_sampler is not None:
        if _is_plain_batch_sampler(batch_sampler):  # BatchSampler(DistributedSampler(...), b, drop_last)
            return unbalanced_reason(dataset, batch_sampler.sampler, None, batch_sampler.batch_size)
        if _is_accelerate_shard(batch_sampler):
            if batch_sampler.batch_size is None:
                return "accelerate BatchSamplerShard without a fixed batch size"
            return None
        return f"a custom batch_sampler ({type(batch_sampler).__name__})"
    if not isinstance(sampler, DistributedSampler):
        return "no DistributedSampler" + ("" if sampler is None else f" (sampler {type(sampler).__name__})")
    if type(sampler).__iter__ is not DistributedSampler.__iter__:
        return f"{type(sampler).__name__} overrides DistributedSampler.__iter__ (its rank split is unknown)"
    if batch_size is None or int(batch_size) < 1:
        return "no batch_size (automatic batching is off)"
    return None


def _is_plain_batch_sampler(obj: Any) -> bool:
    from torch.utils.data import BatchSampler, DistributedSampler

    return type(obj) is BatchSampler and isinstance(obj.sampler, DistributedSampler)


def _is_accelerate_shard(obj: Any) -> bool:
    return type(obj).__name__ == "BatchSamplerShard" and type(obj).__module__.startswith("accelerate")


def balanced_sampler_for(sampler: DistributedSampler | None, batch_sampler: Any, batch_size: int | None,
                         drop_last: bool) -> ShareSampler:
    """The :class:`ShareSampler` for a DataLoader's arguments (``unbalanced_reason`` returned None)."""
    if batch_sampler is not None and _is_plain_batch_sampler(batch_sampler):
        return ShareSampler(_DistributedSource(batch_sampler.sampler, int(batch_sampler.batch_size),
                                               bool(batch_sampler.drop_last)))
    if batch_sampler is not None:
        return ShareSampler(_AccelerateSource(batch_sampler))
    return ShareSampler(_DistributedSource(sampler, int(batch_size), bool(drop_last)))


class ShareSampler:
    """A batch sampler yielding this rank's share of every stock global batch (see the module docstring)."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source
        self.rank = source.rank
        self.world = source.world
        self.sampler = source.sampler
        """The wrapped sampler (``set_epoch`` callers reach it as before)."""
        self.batch_size = source.batch_size
        self.drop_last = source.drop_last
        self.iteration = -1
        """Iterations started (``iter()`` calls); -1 before the first."""
        self.drawn = 0
        """Batches drawn in the current iteration."""
        self.consumed = 0
        """Batches the training loop received in the current iteration."""
        self.outer = False
        """True when an outer adapter (accelerate's DataLoaderShard) reports consumption instead of the inner
        DataLoader iterator."""
        self.trained = False
        """True once a gradient all-reduce followed a batch of this loader (only those loaders are balanced)."""
        self._changes: list[tuple[tuple[int, int], tuple[int, ...] | None, str]] = []
        """Sorted (position, shares per rank for a full global batch or None = stock, weighting)."""
        self._pending: deque[tuple[float, int]] = deque()
        self.current: tuple[float, int] | None = None
        """(gradient factor, samples) of the batch most recently handed to the training loop."""
        self.samples_seen = 0
        self._uneven_warned = False

    # --------------------------------------------------------------------------------------- schedule
    def full_batch(self) -> int:
        return self.source.full_batch()

    def shares_at(self, position: tuple[int, int]) -> tuple[tuple[int, ...] | None, str]:
        shares, weighting = None, "mean"
        for pos, s, w in self._changes:
            if pos <= position:
                shares, weighting = s, w
            else:
                break
        return shares, weighting

    def shares_now(self) -> tuple[int, ...] | None:
        return self.shares_at((self.iteration, self.drawn))[0]

    def schedule(self, position: tuple[int, int], shares: tuple[int, ...] | None, weighting: str) -> None:
        """From ``position`` (not drawn yet on any rank) on, split global batches by ``shares`` (None: stock)."""
        if position < (self.iteration, self.drawn):
            raise RuntimeError(f"share change at {position} is behind this rank's draws "
                               f"({(self.iteration, self.drawn)})")
        self._changes = [c for c in self._changes if c[0] < position] + [(position, shares, weighting)]

    def draw_position(self) -> tuple[int, int]:
        """(iteration, index of the next batch to draw); an iteration not started yet counts as the next one."""
        return self.iteration, self.drawn

    # ------------------------------------------------------------------------------------- iteration
    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int) -> None:
        self.source.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return self._generate()

    def _generate(self) -> Iterator[list[int]]:
        # An iteration begins at its first draw: DataLoader iterators may call iter() twice and drop the first.
        self.iteration += 1
        iteration = self.iteration
        self.drawn = 0
        self.consumed = 0
        self._pending.clear()
        per_rank = self.source.per_rank_batches()
        steps = min(len(b) for b in per_rank)
        if any(len(b) != steps for b in per_rank):  # sources whose ranks differ: stock batches, stock counts
            if not self._uneven_warned:
                self._uneven_warned = True
                logger.warning("memrt: ranks get different numbers of batches from this %s; keeping its own split",
                               self.source.kind)
            for batch in per_rank[self.rank]:
                self._pending.append((1.0, len(batch)))
                self.drawn += 1
                yield batch
            return
        for k in range(steps):
            chunks = [per_rank[r][k] for r in range(self.world)]
            shares, weighting = self.shares_at((iteration, k))
            batch, factor = self._slice(chunks, shares, weighting)
            self._pending.append((factor, len(batch)))
            self.drawn = k + 1
            yield batch

    def _slice(self, chunks: list[list[int]], shares: tuple[int, ...] | None,
               weighting: str) -> tuple[list[int], float]:
        sizes = [len(c) for c in chunks]
        total = sum(sizes)
        if shares is None or total < self.world or (self.source.equal_chunks and len(set(sizes)) != 1):
            return chunks[self.rank], 1.0  # stock: DDP's averaging is right as it is
        glob = list(itertools.chain.from_iterable(chunks))
        per_rank = shares if total == sum(shares) else decide_shares(total, [float(s) for s in shares]).per_rank
        lo = sum(per_rank[:self.rank])
        n = per_rank[self.rank]
        factor = n * self.world / total if weighting == "mean" else 1.0
        return glob[lo:lo + n], factor

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped object's (accelerate reads ``batch_sampler``, ``num_processes``, ...)."""
        source = self.__dict__.get("source")
        target = None if source is None or name.startswith("__") else source.wrapped
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)

    def note_consumed(self) -> None:
        """The training loop received the next batch (in draw order)."""
        if self._pending:
            self.current = self._pending.popleft()
            self.consumed += 1
            self.samples_seen += self.current[1]


def note_consumed_inner(data_iter: Any) -> None:
    """Called after ``_BaseDataLoaderIter.__next__``: note the batch unless an outer adapter reports it."""
    sampler = getattr(data_iter, "_index_sampler", None)
    if isinstance(sampler, ShareSampler) and not sampler.outer:
        sampler.note_consumed()
