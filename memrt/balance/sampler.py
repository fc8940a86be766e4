"""A batch sampler that hands each rank its share of every global batch.

Every rank draws the same permutation (seeded by ``seed + epoch``), cuts it into global batches of B
samples and takes the consecutive slice ``[offset_r, offset_r + b_r)`` of each, so the ranks together
cover every global batch exactly once whatever the shares are. The shares are read when a global batch
is drawn (a ``SpeedBalancer`` changes them only at step boundaries, on every rank at the same step); with
``DataLoader(num_workers=0)`` that is the step that uses the batch. Every rank yields the same number of
batches (``len(dataset) // B``; the incomplete last global batch is dropped so each step has exactly B
samples), so DDP's collectives always pair up: no rank runs out of data first.
"""

from __future__ import annotations

from typing import Any, Iterator, Sized

import torch
from torch.utils.data import Sampler

from memrt.balance.shares import Shares

__all__ = ["BalancedBatchSampler"]


class BalancedBatchSampler(Sampler[list[int]]):
    """Use as ``DataLoader(dataset, batch_sampler=BalancedBatchSampler(...))``.

    ``shares`` is a :class:`Shares` or anything with a ``shares`` attribute (a ``SpeedBalancer``), read
    anew for every global batch; ``rank`` defaults to the source's ``rank``.
    """

    def __init__(self, data: Sized | int, shares: Any, *, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.n = data if isinstance(data, int) else len(data)
        self._source = shares
        if rank is None:
            rank = getattr(shares, "rank", None)
        if rank is None:
            raise ValueError("rank is required when shares is a plain Shares (pass rank=dist.get_rank())")
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        first = self.current_shares()
        if not 0 <= self.rank < len(first.per_rank):
            raise ValueError(f"rank={self.rank} is outside the shares' {len(first.per_rank)} ranks")
        if self.n < first.global_batch:
            raise ValueError(f"the dataset has {self.n} samples, fewer than one global batch of "
                             f"{first.global_batch}: lower global_batch")

    def current_shares(self) -> Shares:
        return self._source if isinstance(self._source, Shares) else self._source.shares

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same on every rank, like ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.current_shares().global_batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        start = 0
        while True:
            shares = self.current_shares()
            if start + shares.global_batch > self.n:
                return
            lo = start + shares.offset(self.rank)
            yield order[lo:lo + shares.per_rank[self.rank]]
            start += shares.global_batch
