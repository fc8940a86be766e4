"""Measure the links of a running job per tier and fit the alpha-beta model, cached per topology.

Three short transfer patterns (send/recv, timed between barriers,
the slowest participant counts), each at a few sizes, fitted by least squares ``t = alpha + n beta``:

- ``intra``: local rank 2k sends to local rank 2k+1, in every node at once;
- ``inter`` alone: local rank 0 of node 0 sends to local rank 0 of node 1 (one flow);
- ``inter`` shared: every local rank of node 0 sends to the same local rank of node 1 at once
  (hierarchical's inter phase: the node's link is shared).

Every transfer and rate is measured on the group's device (:func:`memrt.comm.streams.group_device`:
CUDA tensors on NCCL, timed after ``torch.cuda.synchronize``; CPU tensors on gloo and MPI).

Plus local rates: the reduction (``gamma``) and each codec's encode + decode; and, when memrt.comm's
groups are given, an 8-byte, a 1 MiB and a 16 MiB all-reduce of each algorithm: the first gives the
algorithm's own per-call latency (replacing the formula's alpha terms), the last two its efficiency (measured /
modelled bandwidth time); and an 8-byte and a 1 MiB call of all_gather, reduce_scatter and broadcast per
algorithm, each op's own per-call latency (its formula counts other alpha terms). The result is the
same on every rank (times are max-reduced before fitting) and is cached in
``<cache dir>/comm-links-<topology key>.json``; later runs on the same hosts and grouping load it
instead of probing. Cache dir: ``cache_dir=`` > ``MEMRT_REPORT_DIR`` > ``$XDG_CACHE_HOME/memrt`` >
``~/.cache/memrt``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from memrt.comm.costmodel import MID_CALL_BYTES, PROBED, LinkModel, TierLink

__all__ = ["probe_links", "ensure_link_model", "attach_links", "cache_path", "topology_key", "fit_alpha_beta", "clear_memo",
           "checked_link_model"]

logger = logging.getLogger(__name__)

PROBE_FORMAT = 3
"""Version of what the probe measures; part of the cache key, so that a model cached by an older probe (with
fewer samples of the per-call latencies, or without every op's call overhead) is measured again."""

INTRA_SIZES = (8, 256 << 10, 4 << 20)
"""Bytes per exchange for the intra tier."""
INTER_SIZES = (8, 512 << 10, 4 << 20)
"""Bytes per exchange for the inter tier (well above a token bucket's burst)."""
REPS = 3
"""Timed repetitions per size (the median counts), after one warm-up."""

def clear_memo() -> None:
    """Forget models probed or loaded in this process (tests)."""
    PROBED.clear()


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + n * beta`` over (bytes, seconds) points; both clamped at >= 0."""
    if len(points) < 2:
        raise ValueError(f"fit_alpha_beta needs >= 2 points, got {len(points)}")
    xs = [float(n) for n, _ in points]
    ys = [float(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    beta = max(beta, 0.0)
    alpha = max(my - beta * mx, 0.0)
    if alpha == 0.0:  # keep latency from the smallest message when the line passes below zero
        alpha = max(min(ys) - beta * min(xs), 0.0)
    return alpha, beta


def _host_identity() -> str:
    addrs = []
    try:
        import psutil

        for name, entries in psutil.net_if_addrs().items():
            for e in entries:
                if e.family == socket.AF_INET and not e.address.startswith("127."):
                    addrs.append(e.address)
    except Exception:  # psutil missing or restricted: the hostname alone
        pass
    return socket.gethostname() + "|" + ",".join(sorted(addrs))


def topology_key(nodes: tuple[tuple[int, ...], ...], device_kinds: Sequence[str], hosts: Sequence[str]) -> str:
    """Stable key of (grouping, device kinds, host identities): a different cluster gets a new probe."""
    text = repr((PROBE_FORMAT, tuple(tuple(n) for n in nodes), tuple(device_kinds), tuple(hosts)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(key: str, cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:  # called on its own, without memrt.comm's settings: the environment's
        from memrt.config import load_config

        cache_dir = load_config(warn_unknown=False).measurement_dir
    return Path(cache_dir) / f"comm-links-{key}.json"


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (NCCL calls and CUDA kernels return at enqueue)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pattern(peer: tuple[str, int] | None, nbytes: int, group, device: torch.device | None = None) -> float:
    """Median seconds of one transfer to/from ``peer`` (("send"|"recv", rank); None: idle) between barriers.

    Transfers are one-directional (a sender and a receiver): ring algorithms keep each link busy in
    one direction per flow, and on rate-limited links a flow's ACKs queued behind reverse traffic
    would halve a two-way exchange.
    """
    import torch.distributed as dist

    device = device if device is not None else torch.device("cpu")
    n = max(1, nbytes // 4)
    buf = torch.ones(n, device=device)
    times = []
    for rep in range(REPS + 1):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        if peer is not None:
            (dist.send if peer[0] == "send" else dist.recv)(buf, peer[1], group=group)
            _sync(device)
        dt = time.perf_counter() - t0
        if rep:
            times.append(dt)
    return statistics.median(times) if peer is not None else 0.0


def _local_rates(nbytes: int = 4 << 20, device: torch.device | None = None) -> list[float]:
    from memrt.comm.compress import CODECS, decode, encode

    device = device if device is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0x6D656D)  # private: the user's RNG streams stay untouched
    x = torch.randn(nbytes // 4, generator=gen).to(device)
    y = torch.randn(nbytes // 4, generator=gen).to(device)
    rates = []
    for fn in [lambda: x.add_(y)] + [(lambda c=c: decode(encode(x, c), c, x.numel())) for c in CODECS]:
        fn()
        ts = []
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        rates.append(min(ts) / nbytes)
    return rates


def _time_calls(fns: Sequence[Callable[[], Any]], reps: int = 5, device: torch.device | None = None, *,
                batch: int = 1) -> list[float]:
    """Median seconds per call of each of ``fns``: ``batch`` calls back to back after a barrier (as a job
    issues them; a lone call after a barrier also times how far apart the ranks leave it), alternating
    between the fns (rep k runs each once, the order rotating) so that drift of a shared machine falls on
    all of them alike; one untimed warm-up round."""
    import torch.distributed as dist

    device = device if device is not None else torch.device("cpu")
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for k in range(len(fns)):
            i = (rep + k) % len(fns)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(batch):
                fns[i]()
            _sync(device)
            if rep:
                times[i].append((time.perf_counter() - t0) / batch)
    return [statistics.median(t) for t in times]


SMALL_BATCH = 5
"""8-byte calls are timed five back to back per sample."""
SMALL_REPS = 25
"""Samples of each 8-byte call per algorithm. Flat and hierarchical calls of a few milliseconds can differ by
10-20% where single calls spread by as much (ranks sharing cores), so the per-call latencies that decide small
calls need enough samples to rank the two paths; 25 x ``SMALL_BATCH`` calls take a few seconds once per
topology (the model is cached)."""

CALIBRATION_BYTES = 16 << 20
"""Size of the mid-size call of each algorithm that calibrates its efficiency (four 4 MiB pipeline chunks)."""


_OTHER_OPS = ("all_gather", "reduce_scatter", "broadcast")
"""Ops whose per-call overheads are measured besides all-reduce's (their formulas count other alpha terms)."""


def _op_call(api: Any, op: str, nbytes: int, world: int, device: torch.device) -> Callable[[], Any]:
    """One call of ``op`` of ``nbytes`` through ``api`` (memrt.comm's collectives) in the cost model's
    convention (all_gather: one rank's block; reduce_scatter: the whole input; broadcast: the tensor, from
    rank 0)."""
    numel = max(1, nbytes // 4)
    if op == "all_reduce":
        x = torch.ones(numel, device=device)
        return lambda: api.all_reduce(x)
    if op == "all_gather":
        inp, out = torch.ones(numel, device=device), torch.empty(numel * world, device=device)
        return lambda: api.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        block = max(1, numel // world)
        inp, out = torch.ones(block * world, device=device), torch.empty(block, device=device)
        return lambda: api.reduce_scatter_tensor(out, inp)
    x = torch.ones(numel, device=device)
    return lambda: api.broadcast(x, src=0)


def _call_times(topology, api: Any, device: torch.device | None = None) -> list[float]:
    """Seconds of an 8-byte, a MID_CALL_BYTES and a CALIBRATION_BYTES flat and hierarchical all-reduce, then
    of an 8-byte and a MID_CALL_BYTES call of each of ``_OTHER_OPS`` flat and hierarchical (medians, flat
    and hier alternating; 8-byte calls ``SMALL_BATCH`` back to back per sample). Each call goes through
    memrt.comm's own function (``api``: :mod:`memrt.comm.api`, handed down by its set-up) under its
    ``comm_mode``, so what is timed is what the choice
    picks between (the hand-over to the comm thread, the records); the calls are left out of the comm log
    and the profiler. all_gather and reduce_scatter have a hierarchical path on equal nodes only: elsewhere
    they are not timed."""
    from memrt.comm import events
    from memrt.profiling.recorder import get_recorder

    comm_mode = api.comm_mode

    device = device if device is not None else torch.device("cpu")
    world = sum(len(n) for n in topology.nodes)

    def timed(op: str, nbytes: int, reps: int) -> list[float]:
        call = _op_call(api, op, nbytes, world, device)
        batch = SMALL_BATCH if nbytes < MID_CALL_BYTES else 1

        def under(mode: str) -> Callable[[], Any]:
            def run() -> None:
                with comm_mode(mode), events.quiet():  # memrt's own calls: no profiler events either
                    call()
            return run

        return _time_calls([under("flat"), under("hier")], reps, device, batch=batch)

    log = get_recorder().comm
    seen = len(log)
    out = []
    try:
        for nbytes, reps in ((8, SMALL_REPS), (MID_CALL_BYTES, 9), (CALIBRATION_BYTES, 5)):
            out += timed("all_reduce", nbytes, reps)
        for op in _timed_ops(topology.nodes):
            for nbytes, reps in ((8 * world if op == "reduce_scatter" else 8, SMALL_REPS), (MID_CALL_BYTES, 9)):
                out += timed(op, nbytes, reps)
    finally:
        del log[seen:]
    return out


def _timed_ops(nodes: tuple[tuple[int, ...], ...]) -> tuple[str, ...]:
    """The ops of ``_OTHER_OPS`` that have a choice on ``nodes`` (several nodes; all_gather and
    reduce_scatter: equal nodes)."""
    if len(nodes) <= 1:
        return ()
    uniform = len({len(n) for n in nodes}) == 1
    return tuple(op for op in _OTHER_OPS if uniform or op == "broadcast")


def probe_links(nodes: tuple[tuple[int, ...], ...], *, group=None, key: str = "", topology=None,
                groups=None, collectives: Any = None) -> LinkModel:
    """Run the probe on every rank of ``group`` (collective); return the fitted model (same on all ranks)."""
    import torch.distributed as dist

    from memrt.comm.compress import CODECS
    from memrt.comm.streams import group_device

    t_start = time.perf_counter()
    device = group_device(group)  # NCCL: CUDA tensors (it has no CPU path); gloo / MPI: the CPU
    rank = dist.get_rank(group)
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    mine = nodes[node_of[rank]]
    local = mine.index(rank)
    # intra: local rank 2k sends to 2k+1 in every node at once
    intra_peer = None
    if len(mine) > 1:
        partner = local ^ 1
        if partner < len(mine):
            intra_peer = ("send" if local % 2 == 0 else "recv", mine[partner])
    multi = len(nodes) > 1
    inter_single = inter_shared = None
    if multi and node_of[rank] in (0, 1):
        other = nodes[1 - node_of[rank]]
        direction = "send" if node_of[rank] == 0 else "recv"
        if local < len(other):
            inter_shared = (direction, other[local])
            inter_single = (direction, other[0]) if local == 0 else None
    results = []
    sizes_intra = INTRA_SIZES if any(len(n) > 1 for n in nodes) else ()
    for size in sizes_intra:
        results.append(_time_pattern(intra_peer, size, group, device))
    for size in INTER_SIZES if multi else ():
        results.append(_time_pattern(inter_single, size, group, device))
    for size in INTER_SIZES if multi else ():
        results.append(_time_pattern(inter_shared, size, group, device))
    results.extend(_local_rates(device=device))
    with_overheads = topology is not None and groups is not None and group is None and collectives is not None
    if with_overheads:
        results.extend(_call_times(topology, collectives, device))
    # wall-clock stamp and elapsed time ride along, so every rank ends with the very same model
    vec = torch.tensor(results + [time.time(), time.perf_counter() - t_start], dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    vals = vec.cpu().tolist()
    stamp, elapsed = vals[-2], vals[-1]
    i = 0

    def take(sizes):
        nonlocal i
        pts = list(zip(sizes, vals[i:i + len(sizes)]))
        i += len(sizes)
        return fit_alpha_beta(pts)

    intra = inter = None
    if sizes_intra:
        a, b = take(sizes_intra)
        intra = TierLink(alpha_s=a, beta_s_per_byte=b)
    if multi:
        a1, b1 = take(INTER_SIZES)
        a2, b2 = take(INTER_SIZES)
        inter = TierLink(alpha_s=a1, beta_s_per_byte=b1, shared_beta_s_per_byte=max(b2, b1))
    if intra is None:  # one rank per node: intra never used; mirror inter
        intra = inter if inter is not None else TierLink(alpha_s=0.0, beta_s_per_byte=0.0)
    gamma = vals[i]
    codec = dict(zip(CODECS, vals[i + 1:i + 1 + len(CODECS)]))
    i += 1 + len(CODECS)
    overhead: dict[str, float] = {}
    mid_overhead: dict[str, float] = {}
    efficiency: dict[str, float] = {}
    if with_overheads:
        from memrt.comm import costmodel as cm

        bare = LinkModel(intra=intra, inter=inter, gamma_s_per_byte=gamma)
        small = {"flat": vals[i], "hier": vals[i + 1]}
        one = {"flat": vals[i + 2], "hier": vals[i + 3]}
        mid = {"flat": vals[i + 4], "hier": vals[i + 5]}
        fn = {"flat": cm.flat_all_reduce, "hier": cm.hierarchical_all_reduce}
        for algo in ("flat", "hier"):
            # may be negative: the measured 8-byte call replaces the formula's alpha terms
            overhead[algo] = small[algo] - fn[algo](nodes, 8, bare)
            # the slope between the 1 MiB and the mid-size call, over the modelled one
            modelled = fn[algo](nodes, CALIBRATION_BYTES, bare) - fn[algo](nodes, MID_CALL_BYTES, bare)
            measured = mid[algo] - one[algo]
            efficiency[algo] = min(8.0, max(0.25, measured / modelled)) if modelled > 0 and measured > 0 else 1.0
            bandwidth = fn[algo](nodes, MID_CALL_BYTES, bare) - fn[algo](nodes, 0, bare)
            mid_overhead[algo] = one[algo] - fn[algo](nodes, 0, bare) - efficiency[algo] * bandwidth
        i += 6
        overhead_ops, mid_ops = _op_overheads(nodes, vals[i:], bare, efficiency)
        overhead.update(overhead_ops)
        mid_overhead.update(mid_ops)
    model = LinkModel(intra=intra, inter=inter, gamma_s_per_byte=gamma, codec_s_per_byte=codec, topology_key=key,
                      call_overhead_s=overhead, mid_overhead_s=mid_overhead, efficiency=efficiency,
                      measured_at=_dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).isoformat(timespec="seconds"),
                      probe_seconds=elapsed)
    logger.info("probed links in %.2fs: %s", model.probe_seconds, model)
    return model


def _op_overheads(nodes: tuple[tuple[int, ...], ...], vals: Sequence[float], bare: LinkModel,
                  efficiency: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Per-call overheads of ``_OTHER_OPS`` from their timings (``_call_times``' order): measured minus
    modelled, as all-reduce's, keyed by ``costmodel.overhead_key``."""
    from memrt.comm import costmodel as cm
    from memrt.comm.costmodel import predict

    world = sum(len(n) for n in nodes)
    small, mid = {}, {}
    it = iter(vals)
    for op in _timed_ops(nodes):
        for nbytes in (8 * world if op == "reduce_scatter" else 8, MID_CALL_BYTES):
            for algo in ("flat", "hier"):
                measured = next(it)
                key = cm.overhead_key(op, algo)
                zero = predict(algo, 0, nodes, bare, op=op)
                if nbytes == MID_CALL_BYTES:
                    bandwidth = predict(algo, nbytes, nodes, bare, op=op) - zero
                    mid[key] = measured - zero - efficiency.get(algo, 1.0) * bandwidth
                else:
                    small[key] = measured - predict(algo, nbytes, nodes, bare, op=op)
    return small, mid


def ensure_link_model(nodes: tuple[tuple[int, ...], ...], device_kinds: Sequence[str] = (), *, group=None,
                      cache_dir: str | Path | None = None, force: bool = False, topology=None,
                      groups=None, collectives: Any = None) -> tuple[LinkModel, bool]:
    """The link model for this job: from this process's memo, the cache (rank 0 reads, broadcasts), or a probe.

    Collective over ``group``. Returns (model, probed) where ``probed`` says a probe ran now.
    """
    import torch.distributed as dist

    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, _host_identity(), group=group)
    key = topology_key(nodes, device_kinds, hosts)
    if not force and key in PROBED:
        return PROBED[key], False
    path = cache_path(key, cache_dir)
    msg: list[str | None] = [None]
    if dist.get_rank(group) == 0 and not force and path.exists():
        try:
            text = path.read_text()
            checked_link_model(text)
            msg[0] = text
        except Exception as exc:  # a corrupt cache is re-probed, never trusted
            logger.warning("memrt: ignoring the comm link cache %s (%s); measuring again", path, exc)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(msg, src=src, group=group)
    if msg[0] is not None:
        model = checked_link_model(msg[0])
        PROBED[key] = model
        return model, False
    model = probe_links(nodes, group=group, key=key, topology=topology, groups=groups, collectives=collectives)
    PROBED[key] = model
    if dist.get_rank(group) == 0:
        try:  # private like the reports: folders this creates 0700, the file 0600
            from memrt.profiling.recorder import make_private_dir

            make_private_dir(path.parent)
            tmp = path.with_suffix(".tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(model.to_json())
            tmp.replace(path)
        except OSError as exc:
            logger.warning("could not cache the link model at %s (%s): the next run probes again; "
                           "set MEMRT_REPORT_DIR to a writable directory", path, exc)
    return model, True


def checked_link_model(text: str) -> LinkModel:
    """A cached link model, every figure checked (a finite number of the right sign): ValueError otherwise."""
    import math

    def num(v: object, what: str, low: float | None = 0.0) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (low is not None and v < low):
            raise ValueError(f"{what}={v!r} is not a finite number" + (f" >= {low:g}" if low is not None else ""))

    try:
        model = LinkModel.from_json(text)
    except (TypeError, KeyError, AttributeError) as exc:  # a missing field, or one of the wrong kind
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    for tier in ("intra", "inter"):
        link = getattr(model, tier)
        if link is None and tier == "inter":
            continue
        if link.shared_beta_s_per_byte is not None:
            num(link.shared_beta_s_per_byte, f"{tier}.shared_beta_s_per_byte")
    num(model.gamma_s_per_byte, "gamma_s_per_byte")
    num(model.probe_seconds, "probe_seconds")
    for name, low in (("codec_s_per_byte", 0.0), ("call_overhead_s", None), ("mid_overhead_s", None),
                      ("efficiency", 1e-9)):
        table = getattr(model, name)
        if not isinstance(table, dict):
            raise ValueError(f"{name}={table!r} is not an object")
        for k, v in table.items():
            num(v, f"{name}[{k!r}]", low)
    return model


def attach_links(topology, *, groups=None, cache_dir: str | Path | None = None, collectives: Any = None):
    """``topology`` with ``links`` set to this job's measured :class:`LinkModel` (collective; probes once).

    ``groups`` (memrt.comm's hierarchical groups) and ``collectives`` (:mod:`memrt.comm.api`, which calls
    this at set-up and so cannot be imported from here) let the probe time the calls of each algorithm."""
    import dataclasses

    model, _ = ensure_link_model(topology.nodes, topology.device_kinds, cache_dir=cache_dir, topology=topology,
                                 groups=groups, collectives=collectives)
    return dataclasses.replace(topology, links=model)
