"""How one collective call runs: memrt's comm thread or torch's call, the record.

:func:`decide` asks :func:`memrt.comm.select.decide` with this job's state (the one place a call's algorithm
and codec are decided: a :class:`~memrt.comm.select.Decision`); :func:`measure_trial` runs the measured
pick's trials where that decision asks for them. :func:`run_own` runs memrt's algorithm on the one comm
thread, in call order; :func:`run_flat` runs torch's call as it is. Both record one
:class:`~memrt.profiling.recorder.CommRecord` per user call (bytes per tier, predicted and measured seconds) and
one profiler event of the backend's name.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.distributed as tdist

from memrt.comm import events, select, streams
from memrt.comm.health import check_signatures
from memrt.comm.routing import passthrough, real_backend_name
from memrt.comm.select import Decision, tier_bytes
from memrt.comm.setup import STATE
from memrt.comm.work import MemrtWork, RecordedWork, raise_diagnosed
from memrt.profiling import recorder

__all__ = ["check_arguments", "compressed_inter_hop", "compressed_inter_scatter", "decide", "measure_trial",
           "on_world", "record", "run_flat", "run_own", "sent_per_tier", "world_size"]


def _comm_record(op: str, t: torch.Tensor, nbytes: int, algorithm: str, seconds: float, start: float,
                 tier: dict[str, int], predicted: float | None, redop: str, reason: str) -> recorder.CommRecord:
    """The CommRecord of one user call; its size is nccl-tests' (all_gather: the gathered output, ``nbytes`` x
    ranks)."""
    world = world_size()
    return recorder.CommRecord(
        op=op, dtype=str(t.dtype).replace("torch.", ""), nbytes=int(nbytes) * (world if op == "all_gather" else 1),
        group_size=world, algorithm=algorithm, seconds=seconds, tier_bytes=tier, predicted_seconds=predicted,
        start=start, redop=redop, reason=reason)


def record(op: str, t: torch.Tensor, nbytes: int, algorithm: str, start: float, tier: dict[str, int],
           predicted: float | None, redop: str = "", reason: str = "") -> None:
    """Record one user call that has completed (timed from ``start`` to now)."""
    recorder.get_recorder().record_comm(_comm_record(op, t, nbytes, algorithm, time.perf_counter() - start, start,
                                                     tier, predicted, redop, reason))


def world_size() -> int:
    """Ranks of the default group (the topology's, once discovered)."""
    return STATE.topology.world_size if STATE.topology is not None else tdist.get_world_size()


def sent_per_tier(op: str, algorithm: str, nbytes: int, element_size: int, codec: str | None = None) -> dict[str, int]:
    """Bytes this rank sends per tier for one call on this job's topology (:func:`memrt.comm.select.tier_bytes`)."""
    topo = STATE.topology
    return tier_bytes(algorithm, nbytes, topo.nodes, topo.rank, element_size, op=op, codec=codec)


def decide(op: str, nbytes: int, dtype: torch.dtype, reduce_op: Any = None, src: int = 0, *,
           compress: str | None = None, compressible: bool = True) -> Decision:
    """How this call runs: :func:`memrt.comm.select.decide` with this job's topology, settings, backend, measured
    picks and tier groups. ``compress``: what the call asked for (None: exact); ``compressible``: whether the op's
    own path can carry a compressed inter hop for this call."""
    return select.decide(op, nbytes, dtype, STATE.topology, STATE.config, compress=compress,
                         compressible=compressible, reduce_op=reduce_op, backend=real_backend_name(), src=src,
                         picks=STATE.picks, hier_ready=STATE.groups is not None)


def measure_trial(choice: Decision, t: torch.Tensor, runners: dict[str, Callable[[], Any]]) -> Decision:
    """The choice to run once ``choice``'s trials are done: with a trial key (the first call of a tie, see
    :mod:`memrt.comm.measured_pick`), time ``runners`` (one complete call of each algorithm with the user's own
    arguments) where the call itself would run them: flat on the calling thread, memrt's hierarchical algorithm
    on the comm thread with the caller waiting (its hand-off is part of its cost); then settle the pick with
    the other ranks and return it. The trials are memrt's own calls, not recorded, not profiled; the user's
    call then runs once, recorded."""
    if choice.trial is None:
        return choice
    op = choice.trial[0]

    def on_comm_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> None:  # as run_own: the submission made on the caller's thread, after its earlier work
            sub = streams.DeviceSubmission(t)

            def job() -> None:
                with events.quiet():
                    sub.run(fn)

            STATE.executor.submit(job).result()

        return call

    def sync() -> None:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    timed = {a: on_comm_thread(fn) if a == "hier" else fn for a, fn in runners.items()}
    STATE.executor.submit(lambda: None).result()  # memrt's earlier calls are done: every rank's next call matches
    try:  # the hang watchdog covers the trials and the exchange as it covers a collective
        with (STATE.health.inside(op) if STATE.health is not None else contextlib.nullcontext()), \
                events.quiet(), passthrough():
            STATE.picks.measure(choice.trial, timed, barrier=tdist.barrier, sync=sync,
                                store=tdist.distributed_c10d._get_default_store(),
                                rank=STATE.topology.rank, world=STATE.topology.world_size)
    except Exception as exc:  # noqa: BLE001
        raise_diagnosed(op, exc)
    return select.after_trials(choice, STATE.picks)


def compressed_inter_hop(codec: str | None, base_key: Any, flat_ptr: int) -> Callable | None:
    """The inter-node all-reduce of a hierarchical all-reduce whose inter hop is compressed with ``codec``, None
    for an exact one (``codec`` None).

    ``base_key`` (the DDP hook's gradient buffer, None for a plain call) keys error feedback per chunk of the
    buffer that starts at ``flat_ptr``."""
    if codec is None:
        return None
    from memrt.comm.compress import compressed_all_reduce, feedback_part  # compressed inter-node hop

    def inter(shard: torch.Tensor, group: Any) -> Any:
        # error feedback only for a caller's own gradient buffer (base_key from the DDP hook): per chunk of it
        key = None if base_key is None else feedback_part(base_key, shard.data_ptr() - flat_ptr, shard.numel())
        # async: the payload is on the wire when this returns, the pipeline's wait() decodes it, so the
        # helper thread encodes the next chunk while this one crosses the slow link
        return compressed_all_reduce(shard, group, codec, key, async_op=True)

    return inter


def compressed_inter_scatter(codec: str | None, base_key: Any) -> Callable | None:
    """The inter-node exchange of a hierarchical reduce-scatter compressed with ``codec``, None for an exact one.

    ``base_key`` (the caller's gradient buffer, e.g. one FSDP2 parameter group; None for a plain call) keys
    error feedback per chunk offset of this rank's block and per destination node."""
    if codec is None:
        return None
    from memrt.comm.compress import compressed_reduce_scatter, feedback_part

    def inter(tier: Any, blocks: torch.Tensor, out: torch.Tensor, offset: int) -> Any:
        key = None if base_key is None else feedback_part(base_key, offset, out.numel())
        return compressed_reduce_scatter(tier, blocks, out, codec, key)

    return inter


def run_own(name: str, t: torch.Tensor, nbytes: int, decision: Decision, fn: Callable[[], Any], async_op: bool,
            outputs: list[torch.Tensor], redop: str = "") -> MemrtWork | None:
    """Run memrt's own algorithm ``fn`` for the user's call on the comm thread (one profiler event of the
    backend's name with the user's input ``t``; ``fn``'s internal collectives run unprofiled there), recorded as
    ``decision`` (its label, prediction and reason)."""
    start = time.perf_counter()
    tier = sent_per_tier(name, decision.algorithm, nbytes, t.element_size(), decision.codec)
    algorithm, predicted, reason = decision.label, decision.predicted_seconds, decision.reason
    sub = streams.DeviceSubmission(t)  # CUDA: the worker's device and stream; done = the GPU work is done
    event = events.begin(name, [t])

    def job() -> None:
        try:
            # quiet: a profiler that records every thread would otherwise show fn's sub-collectives
            if STATE.health is not None:
                with STATE.health.inside(name), events.quiet():
                    sub.run(fn)
            else:
                with events.quiet():
                    sub.run(fn)
        except Exception as exc:  # noqa: BLE001
            raise_diagnosed(name, exc)
        finally:
            if event is not None:
                event.end(here=True)
        record(name, t, nbytes, algorithm, start, tier, predicted, redop, reason)

    work = MemrtWork(STATE.executor.submit(job), outputs)
    if async_op:
        return work
    work.wait()
    return None


def run_flat(name: str, t: torch.Tensor, nbytes: int, call: Callable[[], Any], async_op: bool,
             predicted: float | None = None, redop: str = "", reason: str = "") -> Any:
    """Run torch's own collective ``call`` for the user's call, as it is, and record it (on completion for
    ``async_op``: the returned :class:`~memrt.comm.work.RecordedWork`)."""
    start = time.perf_counter()
    tier = sent_per_tier(name, "flat", nbytes, t.element_size())
    timer = _CudaTimer(t) if t.is_cuda else None  # CUDA: seconds and the watchdog follow completion

    def finish() -> None:
        if timer is None:
            record(name, t, nbytes, "flat", start, tier, predicted, redop, reason)
        else:
            timer.finish(name, t, nbytes, start, tier, predicted, redop, reason)

    try:  # passthrough: a memrt process group underneath runs this flat call as it is (no second routing)
        with (STATE.health.inside(name) if STATE.health is not None else contextlib.nullcontext()), passthrough():
            work = call()
            if not async_op and work is not None:  # a real backend's call returns its Work to a blocking caller too
                work.wait()
    except Exception as exc:  # noqa: BLE001
        raise_diagnosed(name, exc)
    if async_op:
        return RecordedWork(work, finish, name)
    finish()
    return None


class _CudaTimer:
    """CUDA events around a flat torch collective: the record's seconds run to completion (read later, no
    host wait) and the hang watchdog watches the end event rather than the enqueue."""

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        self.start_ev = torch.cuda.Event(enable_timing=True)
        self.start_ev.record(torch.cuda.current_stream(self.device))

    def finish(self, name: str, t: torch.Tensor, nbytes: int, start: float, tier: dict[str, int],
               predicted: float | None, redop: str = "", reason: str = "") -> None:
        end_ev = torch.cuda.Event(enable_timing=True)
        end_ev.record(torch.cuda.current_stream(self.device))  # after the call (or wait): joined the comm stream
        if STATE.health is not None and hasattr(STATE.health, "track"):
            STATE.health.track(name, end_ev)
        pending = _comm_record(name, t, nbytes, "flat", 0.0, start, tier, predicted, redop, reason)
        recorder.get_recorder().record_comm_pending(pending, self.start_ev, end_ev)


def check_arguments(op: str, tensor: torch.Tensor, group: Any, *, extra: int = 0) -> None:
    with events.quiet():  # the cross-rank argument check is memrt's collective, not the user's
        check_signatures(op, tensor, group, extra=extra)


def on_world(group: Any) -> bool:
    """Whether a call on ``group`` is memrt's to route: the default group, once initialized."""
    return (group is None or group is tdist.GroupMember.WORLD) and tdist.is_initialized()


