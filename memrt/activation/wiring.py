"""What memrt does to a DDP (or FSDP2) model in an activated process.

For each ``DistributedDataParallel`` construction:

1. **memory**: ``memrt.auto(ddp.module, budget=MEMRT_BUDGET)``; a share (``85%``) resolves against THIS
   rank's device, so ranks of a mixed cluster get different plans. Plans never change gradients, so DDP
   stays correct when they differ.
2. **gradient all-reduce**: memrt.comm's DDP hook, but only when every rank of the DDP group is ready for
   it: a rank whose memrt stepped aside would otherwise run a different collective sequence and hang the
   job. Ranks vote through the process group's store (no device collective), with a timeout.

3. **balance** (``MEMRT_BALANCE`` auto|on): when every rank of the DDP group has the balancer, the comm
   hook is :func:`memrt.balance.hook.weighted_allreduce_hook` around the reduction in 2 (or torch's default
   all-reduce): it applies the step's share factor, then memrt.comm's topology-aware all-reduce and
   compression run as before. DataLoaders over a ``DistributedSampler`` get the share sampler
   (:func:`balance_dataloader`).

Missing pieces (memrt.memory or memrt.comm not installed) are skipped with a debug message; failures
go through :func:`memrt.activation.session.fail` (one warning, memrt steps aside; strict: raise).
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any

from memrt.activation import session as _session
from memrt.activation.session import Session

__all__ = ["setup_ddp", "note_fully_shard", "plan_model", "note_optimizer", "finish_sync", "balance_dataloader",
           "balance_controller", "VOTE_TIMEOUT_S"]

logger = logging.getLogger("memrt.activation")

VOTE_TIMEOUT_S = 60.0
"""How long a rank waits for the others' comm-hook votes before leaving DDP's own all-reduce in place."""


def _device_of(module: Any) -> str | None:
    """The device of the module's first parameter (``cpu``, ``cuda:1``), or None without parameters."""
    param = next(iter(module.parameters()), None)
    return None if param is None else str(param.device)


def _plan_memory(sess: Session, module: Any, entry: dict[str, Any], *, offload: str | None = None) -> None:
    from memrt import auto, disable
    from memrt.activation.budget import model_budget

    try:
        # the session's settings; a share of the device resolves on this rank's device; no MEMRT_BUDGET on a
        # GPU: fit the device (its free memory now, less the margin)
        device = _device_of(module)
        budget, fit = model_budget(sess, device, entry)
        auto(module, budget=budget, offload=offload, config=sess.config)
        if sess.config.plan_out:  # memrt plan: the frontier of the first profiled step, then stop
            from memrt.activation.plan import watch

            watch(sess, module, device or "cpu")
    except Exception:
        try:
            disable(module)
        finally:
            entry["memory"] = "failed"
        raise
    sess.tracked.append(weakref.ref(module))
    entry["memory"] = "planned at step 1 (profile), in force from step 2"
    entry["guarded_steps"] = _guard_steps(module, fit)


def plan_model(sess: Session, module: Any, entry: dict[str, Any]) -> None:
    """``memrt.auto`` for a model a single-process job trains (:mod:`memrt.activation.single`), as for DDP's:
    the session's budget and settings, errors of later steps made warnings, recorded in ``entry``."""
    _plan_memory(sess, module, entry)


def _guard_steps(module: Any, fit: Any = None) -> bool:
    """Make a planner error during training (e.g. an infeasible budget found at step 2) a warning.

    memrt.auto plans inside the model's forward pre-hook; without this its exception would end the job.
    The guard (memrt.memory's public error policy, ``on_plan_error``) removes memrt's hooks from the model
    (the step then runs as without memrt) and warns once. False where the model is not under memrt.auto:
    planner errors then propagate as they are. Under a fit-the-device budget (``fit``) an infeasible budget's
    error says where the budget came from and how to set one.
    """
    try:
        from memrt.activation.budget import explain_error
        from memrt.memory.auto import on_plan_error

        return on_plan_error(module, lambda exc: _session.fail("memory plan during training", explain_error(exc, fit)))
    except Exception:  # noqa: BLE001
        return False


def _carried_by(entry: dict[str, Any], path: str, explanation: str) -> None:
    """Record, where it is chosen, which path carries a model's gradient reductions: ``path`` is the exit
    summary's 'grads via' value (:func:`memrt.activation.report.gradient_path` lists them), ``explanation``
    the report's ``comm_hook`` text."""
    entry["grads_via"], entry["comm_hook"] = path, explanation


def _group_path(ddp: Any) -> str:
    """The gradient path of a DDP model without a memrt hook: its process group's (memrt's own, or torch's)."""
    from memrt.comm.backend import is_memrt_group

    return "memrt pg" if is_memrt_group(getattr(ddp, "process_group", None)) else "torch"


def _hook_path(sess: Session) -> str:
    compress = sess.config.compress
    return "memrt hook" if compress in (None, "none") else f"memrt hook+{compress}"


def _comm_hook_wanted(sess: Session, entry: dict[str, Any], ddp: Any = None) -> Any:
    """memrt.comm.register_ddp_hook when this rank can use it, else None (reason in ``entry``)."""
    if sess.config.comm == "off":
        _carried_by(entry, _group_path(ddp), "off (MEMRT_COMM=off)")
        return None
    from memrt.comm import register_ddp_hook
    from memrt.comm.backend import is_memrt_group

    if is_memrt_group(getattr(ddp, "process_group", None)) and sess.config.compress in (None, "none"):
        # The group already runs memrt's algorithms. Compression still takes the hook: it is what names each
        # gradient bucket, so error feedback stays with its bucket (a plain all_reduce is never compressed).
        _carried_by(entry, "memrt pg", "memrt.comm process group (no hook needed)")
        return None
    return register_ddp_hook


def _group_ranks(ddp: Any, world_size: int) -> list[int]:
    import torch.distributed as dist

    group = getattr(ddp, "process_group", None)
    try:
        return list(dist.get_process_group_ranks(group)) if group is not None else list(range(world_size))
    except Exception:  # noqa: BLE001
        return list(range(world_size))


def _vote(sess: Session, key: str, ok: bool, ranks: list[int]) -> bool:
    """True when every rank in ``ranks`` voted yes within VOTE_TIMEOUT_S."""
    if len(ranks) <= 1:
        return ok
    if sess.store is None:
        return False
    sess.store.set(f"{key}/vote/{sess.rank}", "1" if ok else "0")
    keys = [f"{key}/vote/{r}" for r in ranks]
    try:
        sess.store.wait(keys, timedelta(seconds=VOTE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a rank without memrt never votes
        logger.warning("memrt: not every rank answered within %.0fs; DDP keeps its own all-reduce", VOTE_TIMEOUT_S)
        return False
    return all(sess.store.get(k) == b"1" for k in keys)


def balance_controller(sess: Session) -> Any:
    """The session's balancer, built on first use; None when MEMRT_BALANCE=off, one rank, or no store."""
    if sess.balance is not None:
        return sess.balance
    if sess.config.balance == "off" or sess.world_size < 2 or sess.store is None or _session.is_off():
        return None
    from memrt.balance.auto import AutoBalanceConfig, Controller

    sess.balance = Controller(store=sess.store, rank=sess.rank, world=sess.world_size,
                              config=AutoBalanceConfig.from_config(sess.config))
    return sess.balance


def balance_dataloader(sess: Session, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """Rewrite a DataLoader's arguments to use memrt's share sampler; returns the attributes to restore
    after construction (the script's own sampler and batch size stay visible), or None to leave it as is."""
    ctl = balance_controller(sess)
    if ctl is None:
        return None
    from memrt.balance.loader import balanced_sampler_for, unbalanced_reason

    sampler, batch_sampler = arguments.get("sampler"), arguments.get("batch_sampler")
    batch_size, drop_last = arguments.get("batch_size", 1), bool(arguments.get("drop_last", False))
    reason = unbalanced_reason(arguments.get("dataset"), sampler, batch_sampler, batch_size)
    if reason is not None:
        ctl.skip_loader(reason)
        return None
    share = balanced_sampler_for(sampler, batch_sampler, batch_size, drop_last)
    if share.world != sess.world_size:
        ctl.skip_loader(f"a sampler over {share.world} replicas in a job of {sess.world_size} ranks")
        return None
    ctl.add_loader(share)
    arguments.update(batch_sampler=share, batch_size=1, sampler=None, drop_last=False)
    if arguments.get("shuffle") is False:
        arguments["shuffle"] = None
    if batch_sampler is not None:
        return {}  # the DataLoader had no sampler / batch size of its own: nothing to show again
    return {"sampler": sampler, "batch_size": batch_size, "drop_last": drop_last}


def _register_balanced(sess: Session, ddp: Any, register: Any, entry: dict[str, Any]) -> bool:
    """Register the balanced hook around memrt.comm's hook (``register``) or torch's default all-reduce."""
    from memrt.balance.hook import weighted_allreduce_hook

    ctl = sess.balance
    captured: list[tuple[Any, Any]] = []
    if register is not None:
        ddp.register_comm_hook = lambda state, hook: captured.append((state, hook))  # what memrt.comm registers
        try:
            register(ddp, compress=sess.config.compress, config=sess.config)  # the session's settings, passed down
        finally:
            del ddp.register_comm_hook
    if captured:
        inner_state, inner_hook = captured[0]
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner_state, inner_hook = ddp.process_group, allreduce_hook
    is_timer = not ctl.timing_attached  # the first balanced DDP model times the steps
    ddp.register_comm_hook(ctl.hook_state(inner_hook=inner_hook, inner_state=inner_state, is_timer=is_timer),
                           weighted_allreduce_hook)
    if is_timer:
        ctl.attach_timer(ddp)
        if sess.config.budget is not None or entry.get("budget_fit") is not None:  # a plan under a budget
            ctl.memory_bound = _plan_bound(ddp.module)
    entry["balance"] = f"MEMRT_BALANCE={sess.config.balance}" + (" (times the steps)" if is_timer else "")
    return bool(captured)


def _plan_bound(module: Any) -> Any:
    """Most samples per step from the module's memory plan (its budget, measured bytes per sample)."""
    def bound(local_samples: int) -> int | None:
        from memrt import plan_of
        from memrt.balance.capability import max_samples_from_plan

        plan = plan_of(module)
        return None if plan is None else max_samples_from_plan(plan, local_samples)

    return bound


def _diloco_wanted(sess: Session, ddp: Any) -> bool:
    """``MEMRT_SYNC=diloco`` applies to this DDP model: several nodes, and the model spans every rank."""
    if sess.config.sync != "diloco" or sess.nodes is None or len(sess.nodes) < 2:
        return False
    return _group_ranks(ddp, sess.world_size) == list(range(sess.world_size))


def note_optimizer(sess: Session, optimizer: Any) -> None:
    """An optimizer was built in a distributed job: under ``MEMRT_SYNC=diloco``, the DDP model whose
    parameters it steps gets memrt.sync (collective: every rank builds its optimizers in the same order)."""
    if not sess.sync_waiting:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for item in list(sess.sync_waiting):
        ref, entry = item
        ddp = ref()
        if ddp is None:
            sess.sync_waiting.remove(item)
            continue
        if not any(id(p) in ids for p in ddp.module.parameters()):
            continue
        sess.sync_waiting.remove(item)
        from memrt.comm import get_topology
        from memrt.sync import attach

        sync = attach(ddp, optimizer, config=sess.config, topology=get_topology())
        if sync is None:
            entry["sync"] = "exact"
            continue
        sess.syncs.append(sync)
        entry["sync"] = f"diloco every {sync.every} steps"
        _carried_by(entry, "memrt.sync", "memrt.sync (gradients averaged within the node)")
        sess.comm_hooks += 1
        return


def finish_sync(sess: Session) -> None:
    """The job's end under ``MEMRT_SYNC=diloco`` (collective, at destroy_process_group or exit): a last outer
    step for every model with inner steps since its last one, so every rank ends with one model."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    for sync in sess.syncs:
        try:
            sync.finish()
        except Exception as exc:  # noqa: BLE001
            _session.fail("the final outer step (MEMRT_SYNC=diloco)", exc)


def setup_ddp(sess: Session, ddp: Any) -> None:
    """Memory plan and comm hook for a freshly built DistributedDataParallel (called on every rank)."""
    sess.ddp_count += 1
    module = ddp.module
    entry: dict[str, Any] = {"kind": "ddp", "index": sess.ddp_count, "module": type(module).__name__,
                             "parameters": sum(p.numel() for p in module.parameters()),
                             "budget": str(sess.config.budget) if sess.config.budget else None,
                             "memory": "off", "comm_hook": "no", "grads_via": _group_path(ddp),
                             "device": _device_of(module)}
    sess.models.append(entry)
    if sess.clock is not None:
        from memrt.activation.steptime import time_forward

        time_forward(sess.clock, ddp)
    if _diloco_wanted(sess, ddp):
        # memrt.sync registers its own comm hook (the node's mean) once the optimizer is built: no other hook,
        # no balancing (nodes' samples weigh the outer step instead)
        entry["sync"] = "diloco: waiting for the optimizer"
        sess.sync_waiting.append((weakref.ref(ddp), entry))
        if not _session.is_off():
            try:
                _plan_memory(sess, module, entry)
            except Exception as exc:  # noqa: BLE001
                _session.fail("memory plan for DistributedDataParallel", exc)
        return
    register = None
    if not _session.is_off():
        try:
            _plan_memory(sess, module, entry)
            register = _comm_hook_wanted(sess, entry, ddp)
        except Exception as exc:  # noqa: BLE001
            _session.fail("memory plan for DistributedDataParallel", exc)
            register = None
    ranks = _group_ranks(ddp, sess.world_size)
    comm_ok = _vote(sess, f"ddp{sess.ddp_count}", register is not None and not _session.is_off(), ranks)
    if not comm_ok and register is not None:
        _carried_by(entry, _group_path(ddp), "not on every rank: DDP's own all-reduce kept")
    balance_ok = _vote(sess, f"ddp{sess.ddp_count}/balance", _balance_ready(sess, ddp, ranks), ranks)
    if balance_ok:
        try:
            if _register_balanced(sess, ddp, register if comm_ok else None, entry):
                sess.comm_hooks += 1
                _carried_by(entry, _hook_path(sess), f"memrt.comm (compress={sess.config.compress})")
        except Exception as exc:  # noqa: BLE001
            _session.fail("registering the balanced DDP hook", exc)
        return
    entry["balance"] = "off" if sess.balance is None else "not on every rank"
    if not comm_ok:
        return
    try:
        register(ddp, compress=sess.config.compress, config=sess.config)  # the session's settings, passed down
    except Exception as exc:  # noqa: BLE001
        _session.fail("registering the memrt.comm DDP hook", exc)
        return
    sess.comm_hooks += 1
    _carried_by(entry, _hook_path(sess), f"memrt.comm (compress={sess.config.compress})")


def _balance_ready(sess: Session, _ddp: Any, ranks: list[int]) -> bool:
    """This rank can balance this DDP model: a balancer, memrt on, the whole job in the DDP group."""
    try:
        if _session.is_off() or balance_controller(sess) is None:
            return False
    except Exception as exc:  # noqa: BLE001 - vote no: the job keeps the stock split on every rank
        _session.fail("starting the balancer", exc)
        return False
    return ranks == list(range(sess.world_size))


def note_fully_shard(sess: Session, module: Any) -> None:
    """Record an FSDP2-sharded module in the report; plan memory for a model that holds sharded blocks."""
    from memrt.comm.backend import default_is_memrt

    comm = "memrt process group" if default_is_memrt() else "fsdp2 own"
    via = "memrt pg" if default_is_memrt() else "torch"
    compress = sess.config.compress
    if compress not in (None, "none") and sess.config.comm != "off":
        try:  # the module's own reduce-scatter: error feedback per parameter group
            from memrt.comm.fsdp_comms import MemrtReduceScatter

            module.set_custom_reduce_scatter(MemrtReduceScatter.for_module(module, compress))
            comm = f"memrt.comm reduce-scatter (compress={compress})"
            via = f"memrt rs+{compress}"
        except Exception as exc:  # noqa: BLE001
            _session.fail("FSDP2 gradient compression", exc)
    entry: dict[str, Any] = {"kind": "fsdp2", "module": type(module).__name__,
                             "parameters": sum(p.numel() for p in module.parameters()),
                             "memory": "planned with the module that shards it and its blocks", "comm_hook": comm,
                             "grads_via": via,
                             "budget": str(sess.config.budget) if sess.config.budget else None,
                             "device": _device_of(module)}
    sess.models.append(entry)
    if not _shards_blocks(module):
        return
    # the torchtitan pattern: fully_shard per block, then on the model; the model is planned with its
    # sharded blocks as units (plans never change numerics or collectives, so ranks may differ)
    try:  # keep / recompute only: offloading the activations of sharded blocks is not supported yet
        _plan_memory(sess, module, entry, offload="none")
    except Exception as exc:  # noqa: BLE001
        _session.fail("memory plan for FSDP2", exc)


def _shards_blocks(module: Any) -> bool:
    """True when ``module`` holds other fully_shard modules (it is the model of a per-block FSDP2 job)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)
