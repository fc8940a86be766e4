"""The one exchange between ranks: every rank posts its figures to the process group's store and reads all.

No device collective runs (any backend, any mix of devices, nothing queued behind the job's gradients).
Round ``n`` of an exchange posts ``<prefix>/<n>/<rank>`` (JSON), waits for every rank's key and reads them;
every rank gets the same list, in rank order, and runs the same rule on it. A rank deletes its key of round
``n - 1`` once it read round ``n`` (every rank read round ``n - 1`` before it posted to round ``n``).

``MEMRT=1`` exchanges over the session's store (:class:`memrt.balance.auto.Controller`); a
``SpeedBalancer`` and :func:`gather_capabilities` over the default process group's store, under a prefix
naming the group's ranks and the exchange's creation index (the same on every rank: creation is collective).
"""

from __future__ import annotations

import itertools
import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["KeyValueStore", "StoreExchange", "exchange_for_group", "gather_capabilities"]


class KeyValueStore(Protocol):
    """What the exchange uses of a ``torch.distributed.Store``."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def delete_key(self, key: str) -> bool: ...


class StoreExchange:
    """Rounds of an all-to-all of small JSON figures through a key-value store."""

    def __init__(self, store: KeyValueStore, *, rank: int, world: int, prefix: str = "balance",
                 timeout_s: float = 900.0) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.prefix = prefix
        self.timeout_s = timeout_s
        """How long a rank waits for the others' figures (they arrive within one step of each other)."""
        self.rounds = 0
        """Rounds started on this rank (the key of the next one is ``rounds + 1``)."""

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Post this rank's figures, return every rank's (rank order). Every rank must call it alike."""
        self.rounds += 1
        key = f"{self.prefix}/{self.rounds}"
        self.store.set(f"{key}/{self.rank}", json.dumps(mine))
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        everyone = [json.loads(self.store.get(k)) for k in keys]
        if self.rounds > 1:  # every rank read the previous round before posting to this one
            try:
                self.store.delete_key(f"{self.prefix}/{self.rounds - 1}/{self.rank}")
            except Exception:  # noqa: BLE001 - a store without deletion keeps a few bytes per round
                pass
        return everyone


_CREATED: dict[str, itertools.count] = {}
"""Exchanges created per group (process-wide): the index names the next one's keys."""


def exchange_for_group(group: ProcessGroup | None = None, *, name: str = "api",
                       timeout_s: float = 900.0) -> StoreExchange:
    """A :class:`StoreExchange` over the default store among the ranks of ``group`` (default: all).

    Collective in the sense that every rank of ``group`` must create its exchanges in the same order.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    scope = f"{name}/{','.join(map(str, ranks))}" if group is not None else name
    index = next(_CREATED.setdefault(scope, itertools.count()))
    default = distributed_c10d._get_default_store()  # noqa: SLF001 - torch's (as memrt.comm.setup reads it)
    store = dist.PrefixStore(f"memrt/balance-{scope}/{index}", default)
    return StoreExchange(store, rank=dist.get_rank(group), world=dist.get_world_size(group), prefix="round",
                         timeout_s=timeout_s)


def gather_capabilities(samples_per_s: float, max_samples: int | None,
                        group: ProcessGroup | None = None) -> list[tuple[float, int | None]]:
    """One exchange of (samples/s, memory bound) among ``group``'s ranks; the same list on every rank."""
    everyone = exchange_for_group(group, name="gather").gather({"sps": float(samples_per_s), "bound": max_samples})
    return [(float(p["sps"]), p["bound"]) for p in everyone]
