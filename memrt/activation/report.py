"""Begin the session after ``init_process_group``; at exit write each rank's report and print rank 0's summary.

Nothing here issues a device collective: ranks agree on the run id and exchange their short summaries
through the process group's key-value store (a ``PrefixStore("memrt", ...)``), so no collective runs
before the user picked a device, and none runs at exit after the user destroyed the process group.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Any

from memrt.activation import session as _session
from memrt.activation.banner import format_banner
from memrt.activation.session import Session
from memrt.config import MemrtConfig
from memrt.sizes import format_bytes

__all__ = ["begin", "begin_single", "at_exit", "rank_summary", "format_summary", "format_sync_line", "gradient_path",
           "SUMMARY_HEADER", "STEP_HEADER"]

logger = logging.getLogger("memrt.activation")

SUMMARY_WAIT_S = 10.0
"""How long rank 0 waits at exit for the other ranks' summaries (each rank sends it right after its file)."""


def _default_store() -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: without it ranks fall back to a local run id
        logger.debug("no default store", exc_info=True)
        return None
    from memrt.launcher import attempt_prefix

    return dist.PrefixStore(f"memrt/{attempt_prefix()}".rstrip("/"), store)  # a torchrun restart starts from fresh keys


def _nodes(config: MemrtConfig, world_size: int, backend: str) -> tuple[Any, str]:
    """Ranks per node: MEMRT_TOPOLOGY, else memrt.comm's discovery, else the launcher's local size."""
    if config.topology is not None:
        return config.topology, "MEMRT_TOPOLOGY"
    if "nccl" not in backend:  # discovery may issue collectives: only before a device is chosen on CPU backends
        try:
            from memrt.comm import get_topology

            topo = get_topology()
            return tuple(tuple(n) for n in topo.nodes), "memrt.comm discovery"
        except Exception:  # noqa: BLE001 - comm absent or not ready: the launcher's view still names the shape
            logger.debug("memrt.comm topology unavailable", exc_info=True)
    launch = _session.launch_info_safe()
    per_node = launch.local_world_size
    if launch.launcher != "single" and per_node > 0 and world_size % per_node == 0:
        return tuple(tuple(range(i, i + per_node)) for i in range(0, world_size, per_node)), "launcher"
    return None, "unknown"


def begin(config: MemrtConfig) -> Session:
    """Start the session in this (training) process: run id, topology, banner, report at exit."""
    existing = _session.current()
    if existing is not None:
        return existing
    import torch.distributed as dist

    os.environ["MEMRT_AUTOLOAD_ACTIVE"] = str(os.getpid())  # processes this one starts stay untouched
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    store = _default_store()
    run_id = _session.agree_run_id(store, rank)
    sess = Session(config=config, launch=_session.launch_info_safe(), rank=rank, world_size=world,
                   run_id=run_id, report_dir=_session.report_dir_for(config, run_id), backend=backend,
                   store=store)
    return _start(sess)


def begin_single(config: MemrtConfig, *, device: str | None = None) -> Session:
    """Start the session of a process without a process group (:mod:`memrt.activation.single`): a local run
    id, the same banner and report at exit as a rank of a distributed job. ``device``: the trained model's
    (the banner states the budget memrt derives for it when MEMRT_BUDGET is unset)."""
    existing = _session.current()
    if existing is not None:
        return existing
    os.environ["MEMRT_AUTOLOAD_ACTIVE"] = str(os.getpid())  # processes this one starts stay untouched
    launch = _session.launch_info_safe()
    run_id = _session.agree_run_id(None, launch.rank)
    sess = Session(config=config, launch=launch, rank=launch.rank, world_size=1, run_id=run_id,
                   report_dir=_session.report_dir_for(config, run_id), backend="none", nodes=((launch.rank,),),
                   nodes_source="single process", single=True,
                   gc_frozen={"objects": 0, "seconds": 0.0, "skipped": "single process"})
    return _start(sess, device=device)


def _start(sess: Session, *, device: str | None = None) -> Session:
    """The session becomes current: leftovers swept, report folder checked, banner on rank 0, report at exit."""
    config, rank = sess.config, sess.rank
    _session.set_current(sess)
    from memrt.activation.steptime import start_clock

    sess.clock = start_clock()
    from memrt.activation.checks import default_report_problem, sweep_leftovers

    sweep_leftovers(config)  # what processes of this host killed with SIGKILL left (offload folders, slabs)
    sess.report_problem = default_report_problem(config)
    if sess.report_problem is not None:
        logger.warning("memrt: rank %d will write no report at exit: %s; set MEMRT_REPORT_DIR to a folder memrt "
                       "can write", rank, sess.report_problem)
    if not sess.single:
        sess.nodes, sess.nodes_source = _nodes(config, sess.world_size, sess.backend)
    from memrt.profiling.recorder import get_recorder

    get_recorder().set_meta(run_id=sess.run_id, rank=rank, world_size=sess.world_size,
                            launcher=sess.launch.launcher)
    if rank == 0:
        from memrt.activation.budget import banner_value

        text = format_banner(config=config, launcher=sess.launch.launcher, world_size=sess.world_size,
                             nodes=sess.nodes, nodes_source=sess.nodes_source, backend=sess.backend,
                             run_id=sess.run_id, report_dir=sess.report_dir, budget=banner_value(sess, device))
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    atexit.register(at_exit)
    return sess


def _device(sess: Session) -> dict[str, Any]:
    """This rank's device for the report: the first planned model's, else the one memrt would plan for."""
    import torch

    from memrt.activation.checks import planning_device
    from memrt.memory.meter import device_capacity_bytes

    device = next((m["device"] for m in sess.models if m.get("device")), None)
    if device is None:
        name, capacity = planning_device(sess.launch.local_rank)
        return {"kind": "cuda" if name.startswith("cuda") else "cpu", "name": name, "capacity_bytes": capacity}
    dev = torch.device(device)
    name = f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)
    return {"kind": dev.type, "name": name, "capacity_bytes": device_capacity_bytes(dev)}


def _fitted_budget(sess: Session) -> int | None:
    """The first fit-the-device budget memrt derived in this session (MEMRT_BUDGET unset), or None."""
    return next((fit.budget_bytes for fit in sess.fits.values() if fit is not None), None)


def _budget_bytes(sess: Session, device: dict[str, Any]) -> int | None:
    """MEMRT_BUDGET in bytes on this rank's device (a share resolves against its capacity), else the first
    fit-the-device budget memrt derived, or None."""
    config = sess.config
    if config.budget is None:
        return _fitted_budget(sess)
    if config.budget.bytes is not None:
        return config.budget.bytes
    capacity = device.get("capacity_bytes")
    return config.budget.resolve(int(capacity)) if capacity else None


def _plans(sess: Session) -> list[dict[str, Any]]:
    if sess.plans_of is not None:
        return sess.plans_of()
    out = []
    from memrt import plan_of

    for ref in sess.tracked:
        module = ref()
        if module is None:
            continue
        try:
            plan = plan_of(module)
        except Exception:  # noqa: BLE001
            plan = None
        if plan is None:
            continue
        data = plan.to_json()
        out.append(json.loads(data) if isinstance(data, str) else data)
    return out


def rank_summary(sess: Session, plans: list[dict[str, Any]], comm: list[Any]) -> dict[str, Any]:
    """The few numbers rank 0 prints for this rank."""
    actions: Counter = Counter()
    peak = predicted = None
    budget = _fitted_budget(sess)
    for plan in plans:
        for unit in plan.get("units", []):
            actions[unit.get("action", "?")] += 1
        peak = plan.get("measured_peak_bytes", peak)
        predicted = plan.get("predicted_peak_bytes", predicted)
        budget = plan.get("budget_bytes", budget)
    tiers: Counter = Counter()
    for record in comm:
        for tier, n in (getattr(record, "tier_bytes", None) or {}).items():
            tiers[tier] += int(n)
    return {"rank": sess.rank, "budget": str(sess.config.budget) if sess.config.budget else None,
            "budget_bytes": budget, "measured_peak_bytes": peak, "predicted_peak_bytes": predicted,
            "actions": dict(actions), "comm_calls": len(comm), "tier_bytes": dict(tiers),
            "comm_seconds": sum(float(getattr(r, "seconds", 0.0) or 0.0) for r in comm),
            "grads": gradient_path(sess.models), "failures": len(_failures(sess)),
            "budget_source": "; ".join(dict.fromkeys(m["budget_source"] for m in sess.models
                                                     if m.get("budget_source"))) or None,
            "step": sess.clock.summary() if sess.clock is not None else None}


def _path_of(entry: dict[str, Any]) -> str:
    return str(entry.get("grads_via", "torch"))


def gradient_path(models: list[dict[str, Any]]) -> str:
    """Which path carries this rank's gradient reductions, per model memrt set up: ``memrt pg`` (memrt's
    process group runs DDP's / FSDP2's own collectives), ``memrt hook`` (memrt.comm's DDP comm hook, with its
    codec), ``memrt rs`` (memrt's FSDP2 reduce-scatter), ``memrt.sync`` (MEMRT_SYNC=diloco), ``torch``
    (torch's own), ``none`` (a single process); ``-`` without a model."""
    paths = list(dict.fromkeys(_path_of(e) for e in models))
    return " / ".join(paths) if paths else "-"


def _failures(sess: Session) -> list[str]:
    """memrt's failures in this process and the settings it could not honour (memrt.errors.note_degraded)."""
    from memrt.errors import degraded

    return list(sess.failures) + degraded()


SUMMARY_HEADER = (f"memrt: {'rank':>4} {'budget':>11} {'peak':>11} {'predicted':>11}  {'plan':<26} "
                  f"{'comm':>5} {'bytes per tier':<28} {'grads via':<14} fail")
"""The memory and communication table's header (docs/sections/profiling.md explains each column)."""
STEP_HEADER = (f"memrt: {'rank':>4} {'steps':>6} {'step ms':>9} {'data':>7} {'forward':>8} {'backward':>9} "
               f"{'exposed':>8} {'wait':>7} {'optim':>7} {'other':>7}  {'comm s':>8}")
"""The step-time table's header: mean milliseconds per step (memrt.activation.steptime; ``exposed`` and ``wait``
split the backward's end across ranks, steptime.split_grad_wait), total comm seconds."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def format_summary(sess: Session, summaries: list[dict[str, Any]], missing: list[int]) -> str:
    ordered = sorted(summaries, key=lambda x: x["rank"])
    lines = [f"memrt summary | run {sess.run_id} | {len(summaries)}/{sess.world_size} ranks reported "
             f"| files in {sess.report_dir}", SUMMARY_HEADER]
    for s in ordered:
        plan = ", ".join(f"{n} {a}" for a, n in sorted(s["actions"].items())) or "-"
        tiers = ", ".join(f"{t} {format_bytes(b)}" for t, b in sorted(s["tier_bytes"].items())) or "-"
        budget = format_bytes(s["budget_bytes"]) if s["budget_bytes"] is not None else (s["budget"] or "none")
        lines.append(f"memrt: {s['rank']:>4} {budget:>11} {format_bytes(s['measured_peak_bytes']):>11} "
                     f"{format_bytes(s['predicted_peak_bytes']):>11}  {plan:<26} {s['comm_calls']:>5} {tiers:<28} "
                     f"{s.get('grads', '-'):<14} {s['failures']}")
    timed = [s for s in ordered if s.get("step")]
    if timed:
        from memrt.activation.steptime import split_grad_wait

        lines.append(STEP_HEADER)
        steps = [{"grad_wait": 0.0, **s["step"]} for s in timed]
        for s, t, (exposed, wait) in zip(timed, steps, split_grad_wait(steps)):
            lines.append(f"memrt: {s['rank']:>4} {t['steps']:>6} {_ms(t['step']):>9} {_ms(t['data']):>7} "
                         f"{_ms(t['forward']):>8} {_ms(t['backward']):>9} {_ms(exposed):>8} {_ms(wait):>7} "
                         f"{_ms(t['optimizer']):>7} {_ms(t['other']):>7}  {s.get('comm_seconds', 0.0):>8.2f}")
    from memrt.activation.budget import budget_lines

    lines.extend(budget_lines(ordered))  # no MEMRT_BUDGET: where each rank's budget came from
    if missing:
        lines.append(f"memrt: no summary from rank(s) {missing} within {SUMMARY_WAIT_S:.0f}s (see their files)")
    return "\n".join(lines)


def _exchange(sess: Session, mine: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """Rank 0 gets every rank's summary through the store; other ranks send theirs."""
    if sess.world_size == 1 or sess.store is None:
        return [mine], list(range(1, sess.world_size))
    if sess.rank != 0:
        sess.store.set(f"summary/{sess.rank}", json.dumps(mine))
        return [], []
    got = {0: mine}
    deadline = time.monotonic() + SUMMARY_WAIT_S
    while len(got) < sess.world_size and time.monotonic() < deadline:
        for r in range(1, sess.world_size):
            if r not in got and sess.store.check([f"summary/{r}"]):
                got[r] = json.loads(sess.store.get(f"summary/{r}"))
        if len(got) < sess.world_size:
            time.sleep(0.05)
    return list(got.values()), sorted(set(range(sess.world_size)) - set(got))


def at_exit() -> None:
    """Write ``rank{N}.json`` (plans, memory and comm records) and, on rank 0, print the summary."""
    sess = _session.current()
    if sess is None:
        return
    try:
        from memrt.profiling.recorder import get_recorder

        recorder = get_recorder()
        if sess.syncs:
            from memrt.activation.wiring import finish_sync

            finish_sync(sess)  # MEMRT_SYNC=diloco: one model on every rank (a no-op after destroy_process_group)
        plans = _plans(sess)
        device = _device(sess)
        recorder.set_meta(activation={
            "run_id": sess.run_id, "rank": sess.rank, "world_size": sess.world_size,
            "launcher": sess.launch.launcher, "backend": sess.backend,
            "nodes": [list(n) for n in sess.nodes] if sess.nodes else None, "nodes_source": sess.nodes_source,
            "config": sess.config.effective(), "models": sess.models, "plans": plans,
            "comm_hooks": sess.comm_hooks, "failures": _failures(sess), "device": device,
            "budget_bytes": _budget_bytes(sess, device), "seconds": time.perf_counter() - sess.started_s,
            "balance": sess.balance.report() if sess.balance is not None else None,
            "gc_frozen": sess.gc_frozen, "single_process": sess.single,
            "sync": [sync.summary() for sync in sess.syncs],
            "step": sess.clock.summary() if sess.clock is not None else None, "links": _measured_links(),
        })
        if sess.report_problem is None:
            recorder.write(sess.report_dir, sess.rank)
        comm = list(recorder.comm)  # a copy: appends from other threads do not disturb it
        summaries, missing = _exchange(sess, rank_summary(sess, plans, comm))
        if sess.rank == 0:
            text = format_summary(sess, summaries, missing)
            if sess.balance is not None and (sess.balance.decisions or sess.balance.loaders):
                from memrt.balance.auto import format_summary_line

                text += "\n" + format_summary_line(sess.balance)
            text = "\n".join([text, *(format_sync_line(sync.summary()) for sync in sess.syncs)])
            if sess.summary_lines is not None:
                text = "\n".join([text, *sess.summary_lines(sess)])
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
    except Exception as exc:  # noqa: BLE001 - exit must not fail because of the report
        logger.warning("memrt: writing the report of rank %d failed (%s: %s)", sess.rank, type(exc).__name__, exc)
    finally:
        _stop_comm_threads()
        # Let the store (and, on the rank hosting it, its server thread) close now, while the interpreter is
        # whole, rather than in the C++ destructors run during interpreter teardown.
        sess.store = None


def _measured_links() -> dict[str, Any] | None:
    """The link figures memrt.comm's probe measured or loaded in this process (for ``memrt project``); None when
    it ran none (one node, one rank per node, MEMRT_COMM=off)."""
    costmodel = sys.modules.get("memrt.comm.costmodel")  # never imported here: only a job that used memrt.comm
    probed = getattr(costmodel, "PROBED", None)
    if not probed:
        return None
    return json.loads(next(reversed(probed.values())).to_json())


def format_sync_line(summary: dict[str, Any]) -> str:
    """One summary line for a model under ``MEMRT_SYNC=diloco`` (:meth:`memrt.sync.DiLoCo.summary`)."""
    per_step = summary["outer_bytes_per_step"] / summary["every"]
    k = summary.get("fragments", 1)
    streamed = f", {k} fragments streamed" if k > 1 else ""
    return (f"memrt: sync diloco every {summary['every']} steps across {summary['nodes']} nodes: "
            f"{summary['inner_steps']} inner steps, {summary['outer_steps']} outer steps{streamed} | across nodes "
            f"{format_bytes(summary['outer_bytes_per_step'])} per outer step per rank "
            f"(compress={summary['compress']}; {format_bytes(per_step)} per inner step) | outer state "
            f"{format_bytes(summary['host_bytes'])} host memory")


def _stop_comm_threads() -> None:
    """Stop memrt.comm's heartbeat thread and executor, and let the backend's threads finish, when the job
    exits without destroying its group."""
    comm_setup = sys.modules.get("memrt.comm.setup")  # never imported here: only a job that used memrt.comm
    state = getattr(comm_setup, "STATE", None)
    try:
        if getattr(state, "health", None) is not None:
            state.health.stop()
        if getattr(state, "executor", None) is not None:
            state.executor.shutdown(wait=True)
        if comm_setup is not None and comm_setup.tdist.is_initialized():  # a destroyed group did this already
            comm_setup.let_backend_threads_finish()
    except Exception:  # noqa: BLE001 - best effort at exit
        logger.debug("stopping memrt.comm threads failed", exc_info=True)
