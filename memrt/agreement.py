"""Start-up agreement: the settings every rank of a job must share, compared once when the process group starts.

Settings marked ``agree=True`` in :data:`memrt.config.SETTINGS` (``MEMRT`` itself, ``MEMRT_TOPOLOGY``,
``MEMRT_COMM``, ``MEMRT_COMPRESS``, ``MEMRT_OFFLOAD``, ...) decide which collectives a rank runs: ranks that
differ would wait for each other forever, or match one rank's collective with another kind on the next rank.
So right after ``init_process_group`` (under ``MEMRT=1``: the wrapper in :mod:`memrt.activation.hooks`; and in
:func:`memrt.comm.init_process_group`), before memrt issues any collective:

1. every rank writes its values, and its own start-up error if it has one (a ``MEMRT_TOPOLOGY`` that does
   not cover the world, ...), into the process group's key-value store (``memrt/agree/<n>/<rank>``);
2. rank 0 waits for all of them, compares, and writes one verdict; the other ranks wait for the verdict;
3. on any problem every rank raises :class:`~memrt.errors.AgreementError` (:func:`check_or_exit`: prints one
   line naming the setting, the ranks and their values, and exits 2).

A rank that runs no memrt code (``MEMRT`` unset there and memrt.comm not used) writes nothing, and cannot
be told apart from a rank that is late. How long the others wait for it depends on the backend:

- :data:`AGREE_WAIT_S` when ``init_process_group`` connected every rank before returning (gloo, MPI, or NCCL
  given ``device_id``): every rank has passed init, so a rank running memrt writes within milliseconds;
- :data:`LAZY_AGREE_WAIT_S` when the backend connects at its first collective (NCCL without ``device_id``,
  ``TORCH_GLOO_LAZY_INIT=1``): a peer may still be starting; a warning after :data:`AGREE_WAIT_S` names the
  ranks still missing.

Meanwhile the rank without memrt is blocked in its own first collective (nothing of memrt answers it), so
waiting costs no correctness; when memrt's ranks exit, its collective fails and the launcher stops the job.
No torch at import time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import weakref
from typing import Any

from memrt.config import AGREED_VARIABLES, MemrtConfig, environ, load_config
from memrt.errors import AgreementError, ConfigError

__all__ = ["AGREE_WAIT_S", "LAZY_AGREE_WAIT_S", "VERDICT_MARGIN_S", "check", "check_or_exit", "topology_error",
           "format_ranks", "decide", "rank_message"]

logger = logging.getLogger(__name__)

AGREE_WAIT_S = 10.0
"""Seconds the ranks wait for each other's settings when the backend connected every rank at init."""
LAZY_AGREE_WAIT_S = 300.0
"""Seconds they wait when the backend connects lazily (a peer may not have reached init yet)."""
VERDICT_MARGIN_S = 5.0
"""Extra seconds the other ranks give rank 0 to write its verdict after its own wait."""

_GENERATION = 0
_CHECKED: Any = None  # weakref to the default process group already checked in this process


def topology_error(config: MemrtConfig, world_size: int) -> ConfigError | None:
    """MEMRT_TOPOLOGY must group exactly the job's ranks."""
    if config.topology is None:
        return None
    named = sum(len(node) for node in config.topology)
    if named == world_size:
        return None
    text = ";".join(",".join(map(str, n)) for n in config.topology)
    return ConfigError("MEMRT_TOPOLOGY", text, f"a grouping of exactly the {world_size} ranks of this job "
                                               f"(it names {named}): e.g. {_example(world_size)}")


def _example(world: int) -> str:
    if world % 2 == 0 and world > 2:
        half = world // 2
        return ",".join(map(str, range(half))) + ";" + ",".join(map(str, range(half, world)))
    return ",".join(map(str, range(world)))


def format_ranks(ranks: list[int]) -> str:
    """``[0]`` -> ``rank 0``; ``[0, 1, 2, 5]`` -> ``ranks 0-2,5``."""
    ranks = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _show(value: Any) -> str:
    if value is True:  # as the user writes it: MEMRT=1
        return "1"
    if value is False:
        return "0"
    if value is None:
        return "unset"
    return repr(str(value))


def decide(entries: dict[int, dict[str, Any]], world_size: int, waited_s: float) -> dict[str, Any]:
    """Rank 0's verdict from every rank's entry (``{"values", "sources", "error"}``); missing ranks absent."""
    missing = [r for r in range(world_size) if r not in entries]
    errors = {r: e["error"] for r, e in sorted(entries.items()) if e.get("error")}
    differences: list[str] = []
    order = list(AGREED_VARIABLES) + sorted({v for e in entries.values() for v in e.get("values", {})}
                                            - set(AGREED_VARIABLES))
    for var in order:
        groups: dict[str, list[int]] = {}
        defaults: dict[str, bool] = {}
        for r, e in sorted(entries.items()):
            values = e.get("values", {})
            shown = _show(values[var]) if var in values else "not known to this rank's memrt"
            groups.setdefault(shown, []).append(r)
            defaults[shown] = defaults.get(shown, True) and e.get("sources", {}).get(var) == "default"
        parts = [f"{shown}{' (default)' if defaults[shown] and shown != 'unset' else ''} on {format_ranks(rs)}"
                 for shown, rs in groups.items()]
        if var == "MEMRT" and missing:
            parts.append(f"no memrt settings from {format_ranks(missing)} within {waited_s:.0f} s of "
                         "init_process_group (MEMRT unset or off there)")
        if len(parts) > 1:
            differences.append(f"{var}: " + ", ".join(parts))
    notes = _notes(entries, world_size) if not (errors or differences or missing) else []
    return {"errors": {str(r): m for r, m in errors.items()}, "differences": differences, "missing": missing,
            "notes": notes}


def _notes(entries: dict[int, dict[str, Any]], world_size: int) -> list[str]:
    """Agreed settings that cannot do anything in this job's shape (one line each, naming the setting)."""
    values = entries[0].get("values", {}) if 0 in entries else {}
    codec = values.get("MEMRT_COMPRESS")
    if codec in (None, "none") or values.get("MEMRT_COMM") == "off":
        return []
    if values.get("MEMRT_TOPOLOGY") not in (None, "", "unset"):
        sizes = [len(node.split(",")) for node in str(values["MEMRT_TOPOLOGY"]).split(";")]
    else:
        nodes: dict[str, int] = {}
        for r in range(world_size):
            key = entries[r].get("node") or entries[r].get("host") or f"rank{r}"
            nodes[key] = nodes.get(key, 0) + 1
        sizes = list(nodes.values())
    if len(sizes) == 1:
        why = "every rank is on one node, so there is no inter-node hop to compress"
    elif max(sizes) == 1:
        why = ("every node has one rank, so memrt's all-reduce stays flat (the hierarchical one, whose "
               "inter-node hop is what gets compressed, needs several ranks on a node)")
    else:
        return []
    return [f"MEMRT_COMPRESS={codec} does nothing in this job: {why}; gradients are all-reduced exactly"]


def rank_message(verdict: dict[str, Any], rank: int) -> str | None:
    """The one line this rank prints for ``verdict``, or None when the ranks agree."""
    errors = {int(r): m for r, m in verdict.get("errors", {}).items()}
    if rank in errors:
        return f"{errors[rank]} (rank {rank})"
    if errors:
        first = min(errors)
        return f"{format_ranks(list(errors))} stopped at start-up: {errors[first]}"
    if verdict.get("differences"):
        return ("settings that every rank must share differ: " + "; ".join(verdict["differences"])
                + "; give every rank the same values")
    return None


def _entry(config: MemrtConfig, local_error: BaseException | str | None) -> dict[str, Any]:
    return {"values": config.agreed(), "sources": {v: config.sources.get(v, "default") for v in AGREED_VARIABLES},
            "error": None if local_error is None else str(local_error), "host": socket.gethostname(),
            "node": _node_identity()}


def _node_identity() -> str:
    """Host name plus network namespace, as memrt.comm's topology discovery groups ranks into nodes."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


def _connects_at_init(backend: str, pg: Any) -> bool:
    """True when init_process_group connected every rank before it returned."""
    env = environ()
    backend = backend.lower()
    inner = getattr(pg, "inner_backends", None)  # memrt's process group: the real backends it owns connect
    if callable(inner):
        backend = ",".join(inner().values())
    if "mpi" in backend:
        return True
    if "gloo" in backend and env.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() not in ("1", "true"):
        return True
    if getattr(pg, "bound_device_id", None) is not None:  # NCCL eager init: a collective over every rank
        return True
    return env.get("TORCH_DIST_INIT_BARRIER", "0").strip() == "1"


def _wait(store: Any, keys: list[str], seconds: float) -> bool:
    from datetime import timedelta

    if seconds <= 0:
        return all(store.check([k]) for k in keys)
    try:
        store.wait(keys, timedelta(seconds=seconds))
        return True
    except RuntimeError:  # timed out (DistStoreError is a RuntimeError)
        return False


def _collect(store: Any, keys: list[str], world: int, wait_s: float, lazy: bool) -> tuple[dict[int, Any], float]:
    t0 = time.monotonic()
    first = min(wait_s, AGREE_WAIT_S) if lazy else wait_s
    done = _wait(store, keys, first)
    if not done and lazy and wait_s > first:
        late = [r for r in range(world) if not store.check([keys[r]])]
        logger.warning("memrt: rank 0 has waited %.0f s for the memrt settings of %s (MEMRT must be set on every "
                       "rank); giving up in %.0f s", first, format_ranks(late), wait_s - first)
        done = _wait(store, keys, wait_s - first)
    present = range(world) if done else [r for r in range(world) if store.check([keys[r]])]
    entries = {r: json.loads(store.get(keys[r])) for r in present}
    return entries, time.monotonic() - t0


def check(config: MemrtConfig, *, local_error: BaseException | str | None = None, store: Any = None,
          rank: int | None = None, world_size: int | None = None, wait_s: float | None = None) -> None:
    """Compare the agreed settings of every rank (see the module doc); raises AgreementError on a problem.

    Called once per default process group (later calls return at once). ``store``/``rank``/``world_size``
    default to the default process group's; ``local_error`` is this rank's own start-up error, reported to
    the others so that they stop too.
    """
    global _GENERATION, _CHECKED
    import torch.distributed as dist

    pg = None
    if store is None:
        from torch.distributed import distributed_c10d

        pg = distributed_c10d._get_default_group()  # noqa: SLF001 - the group this agreement is about
        if _CHECKED is not None and _CHECKED() is pg:
            return
        from memrt.launcher import attempt_prefix

        store = dist.PrefixStore(f"memrt/agree/{attempt_prefix()}".rstrip("/"),  # a torchrun restart: fresh keys
                                 distributed_c10d._get_default_store())  # noqa: SLF001
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world_size is None else world_size
    if local_error is None:
        local_error = topology_error(config, world)
    lazy = False
    if wait_s is None:
        lazy = pg is not None and not _connects_at_init(str(dist.get_backend()), pg)
        wait_s = LAZY_AGREE_WAIT_S if lazy else AGREE_WAIT_S
    _GENERATION += 1
    if pg is not None:
        _CHECKED = weakref.ref(pg)
    if world <= 1:
        verdict = decide({0: _entry(config, local_error)}, 1, 0.0)
    else:
        verdict = _exchange(store, f"{_GENERATION}", rank, world, _entry(config, local_error), wait_s, lazy)
    message = rank_message(verdict, rank)
    if message is not None:
        raise AgreementError(message)
    if rank == 0:
        for note in verdict.get("notes", []):
            logger.warning("memrt: %s", note)


def _exchange(store: Any, gen: str, rank: int, world: int, mine: dict[str, Any], wait_s: float,
              lazy: bool) -> dict[str, Any]:
    keys = [f"{gen}/{r}" for r in range(world)]
    verdict_key, read_key = f"{gen}/verdict", f"{gen}/read"
    store.set(keys[rank], json.dumps(mine))
    if rank == 0:
        entries, waited = _collect(store, keys, world, wait_s, lazy)
        verdict = decide(entries, world, waited)
        store.set(verdict_key, json.dumps(verdict))
        if rank_message(verdict, 0) is not None:
            # Rank 0 may host the store (env:// without torchrun): before it exits, let the others read.
            deadline = time.monotonic() + VERDICT_MARGIN_S
            while store.add(read_key, 0) < len(entries) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return verdict
    try:
        if _wait(store, [verdict_key], wait_s) or (store.check([keys[0]]) and
                                                   _wait(store, [verdict_key], VERDICT_MARGIN_S)):
            verdict = json.loads(store.get(verdict_key))
            store.add(read_key, 1)
            return verdict
        # No verdict: rank 0 is not running memrt (its entry never came) or stopped before deciding.
        present = {r: json.loads(store.get(keys[r])) for r in range(world) if store.check([keys[r]])}
    except RuntimeError as exc:  # the store went away: its host (rank 0, or the launcher) stopped
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise AgreementError(f"rank {rank} lost the store while comparing memrt settings ({first}); "
                             "rank 0 stopped: see its output") from None
    if 0 not in present:
        return decide(present, world, wait_s)
    raise AgreementError(f"rank 0 sent its memrt settings but no verdict within {wait_s + VERDICT_MARGIN_S:.0f} s "
                         f"(rank {rank} waited); rank 0 may have stopped: see its output")


def check_or_exit(config: MemrtConfig | None = None, **kwargs: Any) -> MemrtConfig:
    """:func:`check`, printing the problem as one line on this rank and exiting with status 2; returns the
    config the ranks agreed on.

    Without ``config`` the settings are read here; a bad one is this rank's start-up error, told to the
    other ranks too (so that they stop with a line naming it instead of waiting for this rank).
    """
    if config is None:
        try:
            config = load_config(warn_unknown=False)
        except ConfigError as exc:
            config, kwargs["local_error"] = MemrtConfig(), exc
    try:
        check(config, **kwargs)
    except AgreementError as exc:
        sys.stderr.write(f"memrt: error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    return config
