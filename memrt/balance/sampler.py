"""A batch sampler that hands each rank its share of every global batch (the ``SpeedBalancer`` API's).

It is the share sampler ``MEMRT=1`` gives DataLoaders (:class:`memrt.balance.loader.ShareSampler`) over one
more batch source: every rank draws the same permutation (seeded by ``seed + epoch``, as
``DistributedSampler``) and cuts it into global batches of B samples; rank r takes the consecutive slice
``[offset_r, offset_r + b_r)`` of each, so the ranks together cover every global batch exactly once whatever
the shares are. The shares are read when a global batch is drawn (a ``SpeedBalancer`` changes them only at
step boundaries, on every rank at the same step); with ``DataLoader(num_workers=0)`` that is the step that
uses the batch. Every rank yields the same number of batches (``len(dataset) // B``; the incomplete last
global batch is dropped so each step has exactly B samples), so DDP's collectives always pair up: no rank
runs out of data first.
"""

from __future__ import annotations

from typing import Any, Protocol, Sized

import torch
from torch.utils.data import Sampler

from memrt.balance.loader import ShareSampler
from memrt.balance.shares import Shares, uniform_shares

__all__ = ["BalancedBatchSampler", "SharesSource"]


class SharesSource(Protocol):
    """Anything with live ``shares`` and its ``rank`` (a ``SpeedBalancer``)."""

    shares: Shares
    rank: int


class _PermutationSource:
    """Global batches of B consecutive items of a seeded permutation, cut evenly per rank (the stock split)."""

    kind = "BalancedBatchSampler"
    equal_chunks = False
    batch_size = None
    drop_last = True
    sampler = None
    wrapped = None

    def __init__(self, n: int, *, rank: int, world: int, global_batch: int, shuffle: bool, seed: int) -> None:
        self.n, self.rank, self.world, self.global_batch = n, rank, world, global_batch
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def full_batch(self) -> int:
        return self.global_batch

    def __len__(self) -> int:
        return self.n // self.global_batch

    def per_rank_batches(self) -> list[list[list[int]]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        even = uniform_shares(self.global_batch, self.world)
        out: list[list[list[int]]] = [[] for _ in range(self.world)]
        for k in range(len(self)):
            start = k * self.global_batch
            for r in range(self.world):
                lo = start + even.offset(r)
                out[r].append(order[lo:lo + even.per_rank[r]])
        return out

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class BalancedBatchSampler(ShareSampler, Sampler[list[int]]):
    """Use as ``DataLoader(dataset, batch_sampler=BalancedBatchSampler(...))``.

    ``shares`` is a :class:`Shares` or anything with a ``shares`` attribute (a ``SpeedBalancer``), read
    anew for every global batch; ``rank`` defaults to the source's ``rank``.
    """

    def __init__(self, data: Sized | int, shares: Shares | SharesSource, *, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        n = data if isinstance(data, int) else len(data)
        self._shares = shares
        if rank is None and not isinstance(shares, Shares):
            rank = shares.rank
        if rank is None:
            raise ValueError("rank is required when shares is a plain Shares (pass rank=dist.get_rank())")
        first = self.current_shares()
        if not 0 <= int(rank) < len(first.per_rank):
            raise ValueError(f"rank={rank} is outside the shares' {len(first.per_rank)} ranks")
        if n < first.global_batch:
            raise ValueError(f"the dataset has {n} samples, fewer than one global batch of "
                             f"{first.global_batch}: lower global_batch")
        self._order = _PermutationSource(n, rank=int(rank), world=len(first.per_rank),
                                         global_batch=first.global_batch, shuffle=shuffle, seed=seed)
        super().__init__(self._order)
        self.n = n
        self.shuffle = shuffle
        self.seed = seed

    @property
    def epoch(self) -> int:
        return self._order.epoch

    def current_shares(self) -> Shares:
        return self._shares if isinstance(self._shares, Shares) else self._shares.shares

    def shares_at(self, position: tuple[int, int]) -> tuple[tuple[int, ...] | None, str]:
        """The live shares, whatever the position: they change only at step boundaries."""
        return self.current_shares().per_rank, "mean"

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same on every rank, like ``DistributedSampler.set_epoch``)."""
        self._order.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)
