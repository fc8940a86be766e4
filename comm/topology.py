"""The cluster's shape: which ranks share a node, what device each rank has, how the tiers are linked.

Discovery (:func:`discover`) runs once after ``init_process_group`` (on NCCL at the first memrt collective, on
that collective's device: see :mod:`memrt.comm.streams`): one ``all_gather_object`` of each
rank's host identity (host name + network namespace, so namespaces of an emulated cluster count as
nodes), device kind and memory, and launcher local rank. Nodes may hold different numbers of ranks.
``MEMRT_TOPOLOGY="0,1;2,3"`` overrides the grouping (emulation, tests).

The inter-node plan for uneven nodes (:func:`inter_segments`) cuts ``[0, 1)`` at every ``j / k_i``
of every node ``i`` (``k_i`` ranks): each resulting segment has exactly one owner per node and is
all-reduced across nodes by the group of those owners. Every rank owns ``1 / k_i`` of the tensor, so
every inter-node link carries its node's share; no rank is a single root. With equal nodes the
segments are the usual "one inter-node group per local slot".
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Sequence

__all__ = ["Topology", "Segment", "discover", "group_nodes", "inter_segments", "local_identity"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True, slots=True)
class Segment:
    """A piece ``[start, end)`` (fractions of a chunk) reduced across nodes by one inter-node group."""

    start: Fraction
    """Start, as a fraction of the chunk length."""
    end: Fraction
    """End (exclusive), as a fraction of the chunk length."""
    owners: tuple[int, ...]
    """Local rank that owns this piece, per node (node order)."""

    def bounds(self, length: int) -> tuple[int, int]:
        """Element bounds of this piece in a chunk of ``length`` elements."""
        return (length * self.start.numerator) // self.start.denominator, \
            (length * self.end.numerator) // self.end.denominator


def inter_segments(node_sizes: Sequence[int]) -> tuple[Segment, ...]:
    """Common refinement of every node's even split: one segment per distinct owner tuple."""
    if not node_sizes or min(node_sizes) < 1:
        raise ValueError(f"node_sizes={list(node_sizes)!r} is not valid: expected every node to hold >= 1 rank")
    cuts = sorted({Fraction(j, k) for k in node_sizes for j in range(k + 1)})
    segs = []
    for a, b in zip(cuts, cuts[1:]):
        owners = tuple(int(a * k) for k in node_sizes)  # floor(a * k): the slot of node i covering [a, b)
        segs.append(Segment(start=a, end=b, owners=owners))
    return tuple(segs)


def group_nodes(identities: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Ranks grouped by identical host identity; nodes ordered by their lowest rank."""
    order: dict[str, list[int]] = {}
    for rank, ident in enumerate(identities):
        order.setdefault(ident, []).append(rank)
    return tuple(tuple(r) for r in sorted(order.values(), key=lambda rs: rs[0]))


def local_identity() -> str:
    """This process's host identity: host name plus network namespace (namespaces emulate nodes)."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


@dataclass(kw_only=True, frozen=True, slots=True)
class Topology:
    """Nodes, this rank's place among them, device kinds and link figures per tier."""

    nodes: tuple[tuple[int, ...], ...]
    """Global ranks per node (node order = lowest rank first); uneven sizes allowed."""
    rank: int
    """This process's global rank."""
    node_index: int
    """Index in ``nodes`` of this rank's node."""
    local_rank: int
    """Position of this rank in its node."""
    device_kinds: tuple[str, ...]
    """Device kind per global rank (cpu, cuda, ...); MEMRT_FORCE_DEVICE_KIND forces it in tests."""
    device_memory_bytes: tuple[int, ...] = ()
    """Device (or host, for cpu) memory per global rank, bytes; empty when not discovered."""
    hosts: tuple[str, ...] = ()
    """Host identity per global rank (host name|network namespace); empty when not discovered."""
    source: str = "discovered"
    """'discovered' or 'MEMRT_TOPOLOGY' (where the grouping came from)."""
    links: Any = None
    """Measured per-tier link figures (alpha seconds, bytes/s) once probed: a costmodel.LinkModel, else None."""

    def __post_init__(self) -> None:
        flat = sorted(r for n in self.nodes for r in n)
        if flat != list(range(len(flat))) or not all(self.nodes):
            raise ValueError(f"nodes={self.nodes!r} is not valid: expected every rank 0..N-1 exactly once, no empty node")
        if self.device_kinds and len(self.device_kinds) != len(flat):
            raise ValueError(f"device_kinds has {len(self.device_kinds)} entries for {len(flat)} ranks")
        if self.nodes[self.node_index][self.local_rank] != self.rank:
            raise ValueError(f"rank={self.rank} is not local rank {self.local_rank} of node {self.node_index}")

    @classmethod
    def from_nodes(cls, nodes: Sequence[Sequence[int]], rank: int, **kw: Any) -> "Topology":
        nodes_t = tuple(tuple(int(r) for r in n) for n in nodes)
        for i, n in enumerate(nodes_t):
            if rank in n:
                kw.setdefault("device_kinds", ("cpu",) * sum(map(len, nodes_t)))
                return cls(nodes=nodes_t, rank=rank, node_index=i, local_rank=n.index(rank), **kw)
        raise ValueError(f"rank={rank} is not in nodes={nodes_t!r}")

    # ---- derived
    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_index])

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(n) for n in self.nodes)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.node_sizes)) == 1

    @property
    def hierarchical_useful(self) -> bool:
        """More than one node and some node with more than one rank."""
        return self.num_nodes > 1 and max(self.node_sizes) > 1

    def node_of(self, rank: int) -> int:
        for i, n in enumerate(self.nodes):
            if rank in n:
                return i
        raise ValueError(f"rank={rank} is not in this topology (world size {self.world_size})")

    def segments(self) -> tuple[Segment, ...]:
        return inter_segments(self.node_sizes)

    def inter_groups(self) -> tuple[tuple[int, ...], ...]:
        """Global ranks of every inter-node group (one per segment), in segment order."""
        return tuple(tuple(self.nodes[i][o] for i, o in enumerate(s.owners)) for s in self.segments())

    # ---- output
    def table(self) -> str:
        rows = [("node", "ranks", "local size", "device kinds", "host")]
        for i, n in enumerate(self.nodes):
            kinds = ",".join(sorted({self.device_kinds[r] for r in n})) if self.device_kinds else "?"
            if "," in kinds:  # mixed kinds on one node: say which rank has which
                kinds = ",".join(f"{r}:{self.device_kinds[r]}" for r in n)
            host = self.hosts[n[0]].split("|")[0] if self.hosts else "-"
            mark = " *" if i == self.node_index else ""
            rows.append((f"{i}{mark}", ",".join(map(str, n)), str(len(n)), kinds, host))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [f"Topology: {self.world_size} ranks on {self.num_nodes} node(s) ({self.source}); "
                 f"this rank {self.rank} = node {self.node_index} local rank {self.local_rank}"]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.num_nodes > 1:
            groups = "; ".join(",".join(map(str, g)) for g in self.inter_groups())
            lines.append(f"inter-node groups: {groups}")
        if self.links is not None:
            lines.append(f"links: {self.links}")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = [list(n) for n in self.nodes]
        links = self.links
        d["links"] = json.loads(links.to_json()) if hasattr(links, "to_json") else links
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        d = json.loads(text)
        links = d.get("links")
        if isinstance(links, dict) and links:
            try:
                from memrt.comm.costmodel import LinkModel  # optional

                links = LinkModel.from_json(json.dumps(links))
            except Exception:  # noqa: BLE001 - keep the raw figures when the cost model cannot read them
                pass
        return cls(nodes=tuple(tuple(n) for n in d["nodes"]), rank=d["rank"], node_index=d["node_index"],
                   local_rank=d["local_rank"], device_kinds=tuple(d["device_kinds"]),
                   device_memory_bytes=tuple(d.get("device_memory_bytes", ())), hosts=tuple(d.get("hosts", ())),
                   source=d.get("source", "discovered"), links=links)


def _device_kind(rank: int) -> str:
    from memrt.comm.mixed import local_device_kind  # honours MEMRT_FORCE_DEVICE_KIND

    return local_device_kind(rank=rank)


def _device_memory(kind: str) -> int:
    import torch

    if kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # a bare environment (e.g. installed with --no-deps): the kernel's page count
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def discover(group: Any = None, *, override: tuple[tuple[int, ...], ...] | None = None) -> Topology:
    """Collective over the default group: every rank's identity -> :class:`Topology`.

    ``override`` (memrt.comm's set-up passes ``MEMRT_TOPOLOGY``) replaces the grouping; identities are
    still gathered.
    """
    import torch.distributed as dist

    from memrt.launcher import discover_launch

    rank, world = dist.get_rank(), dist.get_world_size()
    kind = _device_kind(rank)
    try:
        launch_local = discover_launch().local_rank
    except Exception:  # noqa: BLE001 - a broken launcher environment must not stop discovery
        launch_local = -1
    mine = {"host": local_identity(), "kind": kind, "mem": _device_memory(kind), "local": launch_local}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if override is not None:
        if sum(len(n) for n in override) != world:
            from memrt.errors import ConfigError

            raise ConfigError("MEMRT_TOPOLOGY", ";".join(",".join(map(str, n)) for n in override),
                              f"a grouping of exactly the {world} ranks of this job")
        nodes, source = override, "MEMRT_TOPOLOGY"
    else:
        nodes, source = group_nodes([e["host"] for e in everyone]), "discovered"
    topo = Topology.from_nodes(nodes, rank, device_kinds=tuple(e["kind"] for e in everyone),
                               device_memory_bytes=tuple(int(e["mem"]) for e in everyone),
                               hosts=tuple(e["host"] for e in everyone), source=source)
    logger.debug("discovered %s", topo)
    return topo
