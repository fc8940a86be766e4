"""Single-process jobs under ``MEMRT=1``: the model an optimizer trains, planned at its first training forward.

A job without a process group (a plain loop, HF ``Trainer`` or Lightning in one process, accelerate without a
launcher, a GAN's two models) builds no ``DistributedDataParallel`` and calls no ``fully_shard``, so the
distributed path (:mod:`memrt.activation.wiring`) never sees its model. Here:

1. ``torch.optim.Optimizer.__init__`` (wrapped by :mod:`memrt.activation.hooks`) calls :func:`note_optimizer`:
   the ids of the parameters it steps are remembered (and the settings are checked: a bad one exits 2 here,
   before training, as the distributed path does at ``init_process_group``).
2. While some optimizer's parameters belong to no module memrt has looked at, one global forward pre-hook
   (``torch.nn.modules.module.register_module_forward_pre_hook``) looks at every forward with grad enabled.
   The first module called whose parameters include an optimizer's is the top-most module the job trains
   (a model's forward runs before its submodules'): it gets ``memrt.auto(module, budget=MEMRT_BUDGET)``,
   its submodules are never looked at again. memrt's step hook is run for this very forward, with its
   positional and keyword inputs, so step 1 is the profiling step as in the distributed path. Wrappers
   (``nn.DataParallel``) are passed over for the module they call; a module already planned is left alone.
3. The global hook goes away once every parameter the optimizers step is covered, or every optimizer has
   stepped once (a model is trained by a forward before its optimizer's step); a new optimizer brings it back.
4. At exit, on rank 0: when memrt did nothing, ONE line says what it saw, why it did nothing and what to
   change (:func:`nothing_line`); a job it planned gets the banner and report of :mod:`memrt.activation.report`,
   with a line per model (:func:`summary_lines`).

On CPU without ``MEMRT_BUDGET`` nothing is planned (CPU memory has no capacity to fit): the exit line says so.
On a GPU without it the model is planned to fit the device (:mod:`memrt.activation.budget`).
Nothing here runs in a job with a process group (the distributed path's), and nothing draws random numbers.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from collections import Counter
from typing import Any

from memrt.activation import session as _session
from memrt.config import MemrtConfig

__all__ = ["arm", "disarm", "note_process_group", "note_optimizer", "nothing_line", "settings_notes",
           "summary_lines", "plans"]

logger = logging.getLogger("memrt.activation")

_ARMED_PID: int | None = None
"""The process that armed the exit line (forked children never print it)."""
_PG_SEEN = False
"""init_process_group was called in this process: the distributed path speaks for it."""
_CONFIG: Any = None
_CONFIG_SAID = False
"""A bad setting was printed (exit 2) when the first optimizer was built."""
_OWNED: dict[int, str] = {}
"""id of a parameter an optimizer steps -> that optimizer's class name."""
_UNCOVERED: set[int] = set()
"""Owned parameter ids no looked-at module holds yet."""
_COVERED_IDS: set[int] = set()
_COVERED: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Modules found (planned or not) and their submodules: never looked at again."""
_NOT_OWNED: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Modules holding no owned parameter (looked at again after a new optimizer)."""
_OPTIMIZERS: list[dict[str, Any]] = []
"""Per optimizer seen: name, parameters, ref (weak), stepped."""
_FOUND: list[dict[str, Any]] = []
"""Per model found: the report entry, and a weak reference to the module (``ref``) when planned."""
_PRE_HANDLE: Any = None
_STEP_HANDLE: Any = None
_PLAN_HANDLE: Any = None
"""The optimizer step post-hook that keeps each planned model's latest plan (the model may be gone at exit)."""


# ------------------------------------------------------------------------------------------- set-up / exit


def arm() -> None:
    """Called when torch is imported in an activated process: the exit line is registered (once)."""
    global _ARMED_PID
    if _ARMED_PID == os.getpid():
        return
    _ARMED_PID = os.getpid()
    atexit.register(at_exit)


def disarm() -> None:
    """Undo :func:`arm` and every hook (``hooks.uninstall``: tests, users that switch memrt off)."""
    global _ARMED_PID, _PG_SEEN, _CONFIG, _CONFIG_SAID, _PLAN_HANDLE
    _remove_hooks()
    if _PLAN_HANDLE is not None:
        _PLAN_HANDLE.remove()
        _PLAN_HANDLE = None
    atexit.unregister(at_exit)
    _ARMED_PID, _PG_SEEN, _CONFIG, _CONFIG_SAID = None, False, None, False
    _OWNED.clear()
    _UNCOVERED.clear()
    _COVERED_IDS.clear()
    _OPTIMIZERS.clear()
    _FOUND.clear()


def note_process_group() -> None:
    """The job calls init_process_group: the distributed path speaks for this process from now on."""
    global _PG_SEEN
    _PG_SEEN = True
    _remove_hooks()


def _distributed() -> bool:
    sess = _session.current()
    if _PG_SEEN or (sess is not None and not sess.single):
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _config() -> Any:
    global _CONFIG, _CONFIG_SAID
    if _CONFIG is None:
        try:
            _CONFIG = _session.load_config_or_exit()  # a bad setting: one line and exit 2, before training
        except SystemExit:
            _CONFIG_SAID = True  # the exit line does not say it again
            raise
    return _CONFIG


# ------------------------------------------------------------------------------------------------ optimizers


def note_optimizer(opt: Any) -> None:
    """A torch.optim optimizer was built: remember what it steps and look for the module that owns it."""
    if _ARMED_PID != os.getpid() or _session.is_off() or _distributed():
        return
    _config()
    os.environ["MEMRT_AUTOLOAD_ACTIVE"] = str(os.getpid())  # this process trains: processes it starts stay untouched
    name = type(opt).__name__
    ids = [id(p) for group in opt.param_groups for p in group["params"]]
    _OPTIMIZERS.append({"name": name, "parameters": len(ids), "ref": weakref.ref(opt), "stepped": False})
    for pid in ids:
        _OWNED.setdefault(pid, name)
        if pid not in _COVERED_IDS:
            _UNCOVERED.add(pid)
    _NOT_OWNED.clear()  # a module that owned nothing may own this optimizer's parameters
    if _UNCOVERED:
        _install_hooks()


def _install_hooks() -> None:
    global _PRE_HANDLE, _STEP_HANDLE
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _PRE_HANDLE is None:
        _PRE_HANDLE = register_module_forward_pre_hook(_forward_pre_hook)
    if _STEP_HANDLE is None:
        _STEP_HANDLE = register_optimizer_step_post_hook(_optimizer_stepped)


def _remove_hooks() -> None:
    global _PRE_HANDLE, _STEP_HANDLE
    for handle in (_PRE_HANDLE, _STEP_HANDLE):
        if handle is not None:
            handle.remove()
    _PRE_HANDLE = _STEP_HANDLE = None


def _optimizer_stepped(opt: Any, _args: Any, _kwargs: Any) -> None:
    """An optimizer's first step: every model it trains has had its training forward by now."""
    for item in _OPTIMIZERS:
        if item["ref"]() is opt:
            item["stepped"] = True
    if all(item["stepped"] or item["ref"]() is None for item in _OPTIMIZERS):
        _remove_hooks()


# ------------------------------------------------------------------------------------------- finding models


def _forward_pre_hook(module: Any, args: tuple) -> Any:
    import torch

    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    try:
        if module in _COVERED or module in _NOT_OWNED:
            return None
    except TypeError:  # a module class that defines __eq__ without __hash__: memrt.auto could not hold it either
        return None
    try:
        return _consider(module, args)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the job goes on as without memrt
        _remove_hooks()
        _session.fail("finding the model this process trains", exc)
        return None


def _wrapper(module: Any) -> bool:
    """A module that only calls the model it wraps (its own forward then reaches the model's)."""
    import torch.nn as nn

    return isinstance(module, nn.DataParallel)


def _consider(module: Any, args: tuple) -> Any:
    if _session.is_off() or _distributed():
        _remove_hooks()
        return None
    params = list(module.parameters())
    owned = [p for p in params if id(p) in _OWNED]
    if not owned:
        for m in module.modules():
            _NOT_OWNED.add(m)
        return None
    if _wrapper(module):
        _NOT_OWNED.add(module)
        return None
    for m in module.modules():
        _COVERED.add(m)
    ids = {id(p) for p in params}
    _COVERED_IDS.update(ids)
    _UNCOVERED.difference_update(ids)
    if not _UNCOVERED:
        _remove_hooks()
    return _found(module, args, params, owned)


def _already_planned(module: Any) -> bool:
    """memrt.auto / memrt.apply already hold this module (the script called them itself): one of its forward
    pre-hooks, or a forward memrt put on one of its units, is memrt.memory's."""
    def memrt_owned(obj: Any) -> bool:
        return type(obj).__module__.startswith("memrt.memory")

    if any(memrt_owned(h) for h in module._forward_pre_hooks.values()):  # noqa: SLF001 - torch's hook table
        return True
    return any(memrt_owned(m.__dict__["forward"]) for m in module.modules() if "forward" in m.__dict__)


def _found(module: Any, args: tuple, params: list[Any], owned: list[Any]) -> Any:
    """The top-most module of a training forward that an optimizer trains: plan it (or say why not)."""
    config = _config()
    device = str(params[0].device)
    optimizers = ", ".join(sorted({_OWNED[id(p)] for p in owned}))
    shown = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model it compiles
    entry: dict[str, Any] = {"kind": "single", "index": len(_FOUND) + 1, "module": type(shown).__name__,
                             "parameters": sum(p.numel() for p in params), "optimizer": optimizers,
                             "budget": str(config.budget) if config.budget else None, "memory": "off",
                             "comm_hook": "none (single process)", "grads_via": "none", "device": device}
    found = {"entry": entry, "ref": None}
    _FOUND.append(found)
    if _already_planned(module):
        entry["memory"] = "planned by the script (memrt.auto / memrt.apply): left as it is"
        return None
    if device.startswith("cpu") and config.budget is None and config.test_device_free is None:
        entry["memory"] = "not planned: no MEMRT_BUDGET on cpu"
        return None
    from memrt.activation.report import begin_single
    from memrt.activation.wiring import plan_model

    sess = begin_single(config, device=device)
    sess.plans_of, sess.summary_lines = plans, summary_lines
    sess.models.append(entry)
    if sess.clock is not None:
        from memrt.activation.steptime import time_forward

        time_forward(sess.clock, module)
    before = set(module._forward_pre_hooks)  # noqa: SLF001 - to run memrt's new step hook for this forward
    try:
        plan_model(sess, module, entry)
    except Exception as exc:  # noqa: BLE001
        _session.fail("memory plan for the model this process trains", exc)
        return None
    found["ref"] = weakref.ref(module)
    _keep_plans()
    return _run_new_pre_hooks(module, args, before, entry)


def _keep_plans() -> None:
    """After every optimizer step, keep each planned model's plan in force (a script whose model is gone by
    exit, e.g. built inside ``main()``, still gets its plan and measured peak in the summary)."""
    global _PLAN_HANDLE
    if _PLAN_HANDLE is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _PLAN_HANDLE = register_optimizer_step_post_hook(lambda _opt, _args, _kwargs: _poll_plans())


def _poll_plans() -> None:
    from memrt.memory.auto import plan_of

    for found in _FOUND:
        module = found["ref"]() if found["ref"] is not None else None
        if module is not None:
            plan = plan_of(module)
            if plan is not None:
                found["plan"] = plan


def plans() -> list[dict[str, Any]]:
    """The latest plan of every planned model (as ``Plan.to_dict()``), for the report."""
    _poll_plans()
    return [found["plan"].to_dict() for found in _FOUND if found.get("plan") is not None]


def _call_kwargs(module: Any) -> dict | None:
    """The keyword inputs of the forward being called on ``module`` (torch's ``_call_impl`` holds them in the
    frame that calls the global pre-hooks: torch gives global pre-hooks the positional inputs only), or None
    where that frame is not found (another torch version)."""
    frame = sys._getframe(1)  # noqa: SLF001
    for _ in range(8):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "inner" and "kwargs" in code.co_freevars and "self" in code.co_freevars:
            local = frame.f_locals
            if local.get("self") is module and isinstance(local.get("kwargs"), dict):
                return local["kwargs"]
        frame = frame.f_back
    return None


def _run_new_pre_hooks(module: Any, args: tuple, before: set[int], entry: dict[str, Any]) -> Any:
    """Run the forward pre-hooks memrt.auto just registered on ``module`` for the forward already under way
    (torch took its list of hooks before this global one ran), as torch would have run them."""
    hooks = module._forward_pre_hooks  # noqa: SLF001
    with_kwargs = module._forward_pre_hooks_with_kwargs  # noqa: SLF001
    added = [(hid, hook) for hid, hook in hooks.items() if hid not in before]
    if not added:
        return None
    kwargs = _call_kwargs(module)
    if kwargs is None:
        entry["memory"] = ("planned at step 2 (profile), in force from step 3 (the first training forward had "
                           "begun: its keyword inputs were out of reach)")
        return None
    for hid, hook in added:
        if hid in with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, new_kwargs = result
                if new_kwargs is not kwargs:
                    kwargs.clear()
                    kwargs.update(new_kwargs)
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args


# ------------------------------------------------------------------------------------------------- at exit


def settings_notes(config: MemrtConfig) -> str | None:
    """The settings given that act on collectives between ranks, which a single process does not run."""
    given = []
    for var, value, idle in (("MEMRT_COMPRESS", config.compress, ("none",)),
                             ("MEMRT_BALANCE", config.balance, ("off",)),
                             ("MEMRT_COMM", config.comm, ("off",)),
                             ("MEMRT_TOPOLOGY", config.topology, (None,)),
                             ("MEMRT_PROCESS_GROUP", config.process_group, ("off", "false", False)),
                             ("MEMRT_SYNC", getattr(config, "sync", "exact"), ("exact",))):
        if config.sources.get(var, "default") != "default" and value not in idle:
            if var == "MEMRT_TOPOLOGY":
                value = ";".join(",".join(map(str, n)) for n in value)
            given.append(f"{var}={value}")
    if not given:
        return None
    verb = "does" if len(given) == 1 else "do"
    return (f"{' and '.join(given)} {verb} nothing in a single process (they act on collectives between ranks: "
            f"launch with torchrun or mpiexec and DDP / FSDP to use them)")


def _describe(entry: dict[str, Any]) -> str:
    return (f"{entry['module']} ({entry['optimizer']}, {entry['parameters'] / 1e6:.2f}M parameters, "
            f"{entry['device']})")


def nothing_line(config: MemrtConfig) -> str | None:
    """The one line for a single process in which memrt did nothing (None when it acted)."""
    notes = settings_notes(config)
    tail = f"; {notes}" if notes else ""
    unplanned = [f["entry"] for f in _FOUND if f["ref"] is None]
    if _FOUND and len(unplanned) < len(_FOUND):
        return None  # something was planned: the session's summary speaks
    if unplanned:
        kinds = {e["memory"] for e in unplanned}
        models = ", ".join(_describe(e) for e in unplanned)
        if kinds == {"not planned: no MEMRT_BUDGET on cpu"}:
            return (f"memrt: single process, trained {models}, no MEMRT_BUDGET on CPU: no memory plan "
                    f"(set MEMRT_BUDGET=60% to plan){tail}")
        return f"memrt: single process, trained {models}: {'; '.join(sorted(kinds))}{tail}"
    if _OPTIMIZERS:
        names = ", ".join(sorted({o["name"] for o in _OPTIMIZERS}))
        return (f"memrt: single process, {names} built but no forward with grad enabled of a module holding its "
                f"parameters was seen: no model to plan (memrt plans the module a torch.optim optimizer "
                f"trains, at its first training forward){tail}")
    return (f"memrt: single process, no torch.optim optimizer built (nothing trained): no model to plan "
            f"(memrt plans the model an optimizer trains, or the DDP / FSDP model of a torchrun job){tail}")


def at_exit() -> None:
    """Rank 0 of a process with no process group and no session: the one nothing-to-act-on line."""
    if _ARMED_PID != os.getpid():
        return
    try:
        if (_PG_SEEN or _CONFIG_SAID or _session.current() is not None or _session.is_off()
                or "memrt.cli" in sys.modules):
            return
        if _session.launch_info_safe().rank != 0:
            return
        from memrt.config import load_config
        from memrt.errors import ConfigError

        try:
            config = _CONFIG if _CONFIG is not None else load_config(warn_unknown=False)
        except ConfigError as exc:
            sys.stderr.write(f"memrt: error: {exc}\n")
            return
        line = nothing_line(config)
        if line:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
    except Exception:  # noqa: BLE001 - exit must not fail because of memrt
        logger.debug("memrt: the single-process exit line failed", exc_info=True)


_ACTIONS = {"keep": "kept", "recompute": "recomputed", "offload_disk": "offloaded to disk",
            "offload_host": "offloaded to host memory"}


def summary_lines(sess: Any) -> list[str]:
    """One line per model of a single-process session: its plan (units kept / recomputed / offloaded), its
    budget and its measured peak; then the settings that did nothing here."""
    from memrt.sizes import format_bytes

    _poll_plans()
    lines = []
    for found in _FOUND:
        entry = found["entry"]
        plan = found.get("plan")
        if plan is None:
            lines.append(f"memrt: model {entry['index']} {_describe(entry)}: no plan ({entry['memory']})")
            continue
        actions = Counter(u.action for u in plan.units)
        units = ", ".join(f"{n} {_ACTIONS.get(a, a)}" for a, n in sorted(actions.items())) or "no units"
        budget = "none (plan for speed)" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
        if entry.get("budget") and entry["budget"].endswith("%"):
            budget += f" = {entry['budget']}"
        if entry.get("budget_fit") is not None:  # no MEMRT_BUDGET (the summary's budget line has the figures)
            budget += " = fit the device"
        peak = ("not measured yet (train at least 3 steps)" if plan.measured_peak_bytes is None
                else f"{format_bytes(plan.measured_peak_bytes)} measured")
        lines.append(f"memrt: model {entry['index']} {_describe(entry)}: {len(plan.units)} units: {units} | "
                     f"budget {budget} | peak {peak}, {format_bytes(plan.predicted_peak_bytes)} predicted")
    notes = settings_notes(sess.config)
    if notes:
        lines.append(f"memrt: {notes}")
    return lines
