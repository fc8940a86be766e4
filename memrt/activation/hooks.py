"""The post-import hook on torch and memrt's wrappers of the torch entry points an unchanged job calls.

:func:`install` registers a meta-path finder that waits for ``torch`` (and, later, ``torch.distributed.fsdp``)
to finish importing, then wraps, in place:

- ``torch.optim.Optimizer.__init__``: in a process without a process group, the optimizer's parameters lead to
  the model it trains, planned at its first training forward (:mod:`memrt.activation.single`); in a
  distributed job under ``MEMRT_SYNC=diloco``, the DDP model it steps gets :mod:`memrt.sync`.
- ``torch.distributed.init_process_group``: validates the settings first (bad ones exit 2 before any
  rendezvous), supplies an MPI rendezvous when the job runs under mpiexec without ``MASTER_ADDR``, swaps
  a gloo / NCCL backend for memrt's process group (:mod:`memrt.comm.backend`: every collective of the
  job through memrt; not under ``MEMRT_COMM=off``), calls the original, compares the settings every rank
  must share (:mod:`memrt.agreement`: a mismatch exits 2 on every rank), then begins the session (run id,
  topology, banner, report at exit).
- ``destroy_process_group``: the last outer step under ``MEMRT_SYNC=diloco``, then memrt.comm's teardown.
- ``DistributedDataParallel.__init__``: after the original, plans memory for the wrapped module
  (``memrt.auto``), registers memrt.comm's gradient hook when every rank of the DDP group is ready, and
  freezes the job's set-up for Python's garbage collector (:mod:`memrt.activation.collector`).
- ``fully_shard`` (FSDP2): begins the session, records the sharded modules and, at the first, freezes the
  job's set-up.
- ``DataLoader.__init__``: a DataLoader over a ``DistributedSampler`` (or accelerate's ``BatchSamplerShard``)
  gets memrt's share sampler (:mod:`memrt.balance.loader`), which yields the stock batches until the ranks
  agree on balanced shares (``MEMRT_BALANCE``, :mod:`memrt.balance.auto`); the DataLoader iterator's
  ``__next__`` (and accelerate's ``DataLoaderShard.__iter__``) note which batch reached the training loop
  and time the wait for it (:mod:`memrt.activation.steptime`), and ``torch.autograd.backward`` lets the
  balancer see the reduction of the loss.

Each wrapper calls the original exactly once whatever memrt does, and a memrt failure falls back to it
(:func:`memrt.activation.session.fail`).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from typing import Any, Callable

from memrt.activation import session as _session
from memrt.config import MemrtConfig

__all__ = ["install", "uninstall", "installed", "PostImportFinder"]

_LOCK = threading.Lock()
_FINDER: "PostImportFinder | None" = None
_ORIGINALS: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to undo in uninstall()
_WRAPPED_MARK = "__memrt_wrapped__"


class _LoaderProxy(importlib.abc.Loader):
    """Runs the real loader, then the callback with the fresh module."""

    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader  # what introspection (inspect, linecache) expects
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Calls ``callbacks[name](module)`` right after module ``name`` finishes importing."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]) -> None:
        self.callbacks = dict(callbacks)
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.callbacks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        callback = self.callbacks.pop(fullname)
        spec.loader = _LoaderProxy(spec.loader, callback)
        if not self.callbacks:
            _remove_finder()
        return spec


def _remove_finder() -> None:
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None


def installed() -> bool:
    """True when the post-import hook is waiting or the wrappers are in place."""
    return _FINDER is not None or bool(_ORIGINALS)


def install() -> None:
    """Register the post-import hook (or wrap at once when torch is already imported). Idempotent."""
    global _FINDER
    with _LOCK:
        if installed():
            return
        callbacks = {}
        if "torch" in sys.modules and hasattr(sys.modules["torch"], "nn"):
            _guarded_on_torch(sys.modules["torch"])
        else:
            callbacks["torch"] = _guarded_on_torch
        if "torch.distributed.fsdp" in sys.modules:
            _guarded_on_fsdp(sys.modules["torch.distributed.fsdp"])
        else:
            callbacks["torch.distributed.fsdp"] = _guarded_on_fsdp
        if "accelerate.data_loader" in sys.modules:
            _guarded_on_accelerate(sys.modules["accelerate.data_loader"])
        else:
            callbacks["accelerate.data_loader"] = _guarded_on_accelerate
        _FINDER = PostImportFinder(callbacks)
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the hook and every wrapper (tests, ``memrt.activation`` users that switch off)."""
    with _LOCK:
        _remove_finder()
        single = sys.modules.get("memrt.activation.single")
        if single is not None:
            single.disarm()
        while _ORIGINALS:
            owner, name, original = _ORIGINALS.pop()
            setattr(owner, name, original)


def _replace(owner: Any, name: str, make_wrapper: Callable[[Any], Any]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, _WRAPPED_MARK, False):
        return
    wrapper = make_wrapper(original)
    setattr(wrapper, _WRAPPED_MARK, True)
    setattr(owner, name, wrapper)
    _ORIGINALS.append((owner, name, original))


def _guarded_on_torch(torch_module: Any) -> None:
    try:
        _on_torch(torch_module)
    except Exception as exc:  # noqa: BLE001 - an import of torch must never fail because of memrt
        uninstall()
        _session.fail("post-import hook on torch", exc)


def _guarded_on_fsdp(fsdp_module: Any) -> None:
    try:
        _on_fsdp(fsdp_module)
    except Exception as exc:  # noqa: BLE001
        _session.fail("post-import hook on torch.distributed.fsdp", exc)


def _guarded_on_accelerate(module: Any) -> None:
    try:
        shard = getattr(module, "DataLoaderShard", None)
        if shard is not None:
            _replace(shard, "__iter__", _wrap_shard_iter)
    except Exception as exc:  # noqa: BLE001
        _session.fail("post-import hook on accelerate.data_loader", exc)


def _on_torch(torch_module: Any) -> None:
    import torch.distributed as dist

    from memrt.activation import single

    _replace(torch_module.optim.Optimizer, "__init__", _wrap_optimizer_init)  # single-process jobs
    single.arm()
    if not dist.is_available():
        return
    from torch.utils.data import DataLoader, dataloader

    _replace(DataLoader, "__init__", _wrap_dataloader_init)
    _replace(dataloader._BaseDataLoaderIter, "__next__", _wrap_iter_next)
    _replace(torch_module.autograd, "backward", _wrap_backward)
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel

    # One wrapper per function, shared by torch.distributed and distributed_c10d (the first original wins).
    make_init = _wrap_once(_wrap_init_process_group)
    _replace(distributed_c10d, "init_process_group", make_init)
    _replace(dist, "init_process_group", make_init)
    make_destroy = _wrap_once(_wrap_destroy_process_group)
    _replace(distributed_c10d, "destroy_process_group", make_destroy)
    _replace(dist, "destroy_process_group", make_destroy)
    _replace(DistributedDataParallel, "__init__", _wrap_ddp_init)


def _wrap_once(wrap: Any) -> Any:
    """``make(original)`` that builds ``wrap(original)`` on its first call and returns that same wrapper after."""
    built: list[Any] = []

    def make(original: Any) -> Any:
        if not built:
            built.append(wrap(original))
        return built[0]

    return make


def _on_fsdp(fsdp_module: Any) -> None:
    wrapped = None

    def make(original):
        nonlocal wrapped
        if wrapped is None:
            wrapped = _wrap_fully_shard(original)
        return wrapped

    _replace(fsdp_module, "fully_shard", make)
    for name in ("torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed._composable.fsdp"):
        if name in sys.modules:
            _replace(sys.modules[name], "fully_shard", make)


# ----------------------------------------------------------------------------------------------- wrappers


def _wrap_init_process_group(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        from memrt.activation.single import note_process_group

        note_process_group()  # a distributed job: the single-process path steps aside
        if _session.is_off() or _session.current() is not None:
            return original(*args, **kwargs)
        config = _session.load_config_or_exit()  # SystemExit(2) on a bad setting, before any rendezvous
        try:
            from memrt.activation.mpi import rendezvous_kwargs

            kwargs = rendezvous_kwargs(args, kwargs)
        except Exception as exc:  # noqa: BLE001
            _session.fail("MPI rendezvous", exc)
        args, kwargs, switched = _memrt_backend(args, kwargs, config)
        result = original(*args, **kwargs)
        if not _session.is_off():
            _agree(config)  # SystemExit(2) when the ranks' settings differ, before memrt's first collective
        if not _session.is_off():
            try:
                from memrt.activation.report import begin

                begin(config)
                if switched:
                    from memrt.comm.backend import ensure_topology

                    ensure_topology(config)  # collective: every rank is here, right after init
            except Exception as exc:  # noqa: BLE001
                _session.fail("start-up after init_process_group", exc)
        return result

    return init_process_group


def _memrt_backend(args: tuple, kwargs: dict, config: MemrtConfig) -> tuple[tuple, dict, bool]:
    """The script's backend replaced by memrt's process group (memrt.comm.backend), unless MEMRT_PROCESS_GROUP
    is off, and where it can carry the job."""
    if config.process_group == "off":
        return args, kwargs, False
    try:
        from memrt.comm.backend import activation_kwargs

        return activation_kwargs(args, kwargs, config.comm, when=config.process_group)
    except Exception as exc:  # noqa: BLE001 - torch's own backend then, as the script asked
        _session.fail("memrt process group", exc)
        return args, kwargs, False


_DESTROYING = threading.local()


def _wrap_destroy_process_group(original: Callable) -> Callable:
    """torch's destroy_process_group also tears down what activation set up in memrt.comm (its heartbeat
    thread and executor), as ``memrt.comm.destroy_process_group`` would."""

    @functools.wraps(original)
    def destroy_process_group(group=None):
        comm_setup = sys.modules.get("memrt.comm.setup")
        if (getattr(_DESTROYING, "active", False) or _session.current() is None or comm_setup is None
                or comm_setup.STATE.topology is None):
            return original(group)
        import torch.distributed as dist

        if group is not None and group is not dist.GroupMember.WORLD:
            return original(group)
        _DESTROYING.active = True
        try:
            from memrt.activation.wiring import finish_sync

            finish_sync(_session.current())  # MEMRT_SYNC=diloco: one model on every rank before the end
            comm_setup.destroy_process_group(group)  # ends in torch's own (this wrapper passes it through)
        except Exception as exc:  # noqa: BLE001
            _session.fail("memrt.comm teardown", exc)
            if dist.is_initialized():
                original(group)
        finally:
            _DESTROYING.active = False

    return destroy_process_group


def _ensure_session() -> "_session.Session | None":
    """The session, begun now when the process group was initialized without the wrapper."""
    sess = _session.current()
    if sess is not None or _session.is_off():
        return sess  # after a failure the session still votes (no) so other ranks do not wait
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    config = _session.load_config_or_exit()
    _agree(config)
    if _session.is_off():
        return None
    try:
        from memrt.activation.report import begin

        return begin(config)
    except Exception as exc:  # noqa: BLE001
        _session.fail("start-up", exc)
        return None


def _agree(config: MemrtConfig) -> None:
    """Compare the settings every rank must share (memrt.agreement): exit 2 on a mismatch on every rank."""
    try:
        from memrt.agreement import check_or_exit

        check_or_exit(config)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken store: memrt steps aside on this rank
        _session.fail("comparing settings across ranks", exc)


def _wrap_ddp_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        sess = _ensure_session()
        original(self, module, *args, **kwargs)
        if sess is not None:
            from memrt.activation.collector import freeze_setup
            from memrt.activation.wiring import setup_ddp

            setup_ddp(sess, self)
            if not _session.is_off():
                freeze_setup(sess)

    return __init__


def _wrap_optimizer_init(original: Callable) -> Callable:
    """``torch.optim.Optimizer.__init__`` (every optimizer's, through ``super().__init__``): in a process
    without a process group, the parameters it steps lead memrt to the model (:mod:`memrt.activation.single`)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not _session.is_off():
            try:
                sess = _session.current()
                if sess is not None and not sess.single:
                    from memrt.activation.wiring import note_optimizer

                    note_optimizer(sess, self)  # MEMRT_SYNC=diloco starts with the DDP model's optimizer
                else:
                    from memrt.activation.single import note_optimizer as note_single

                    note_single(self)
            except SystemExit:
                raise
            except Exception as exc:  # noqa: BLE001
                _session.fail("watching an optimizer", exc)

    return __init__


def _wrap_dataloader_init(original: Callable) -> Callable:
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        restore = None
        if not _session.is_off() and _session.current() is not None:
            try:
                from memrt.activation.wiring import balance_dataloader

                bound = signature.bind(self, *args, **kwargs)
                restore = balance_dataloader(_session.current(), bound.arguments)
                if restore is not None:
                    args, kwargs = (), {k: v for k, v in bound.arguments.items() if k != "self"}
                    extra = kwargs.pop("kwargs", None)  # a **kwargs parameter of a subclass's signature
                    kwargs.update(extra or {})
            except Exception as exc:  # noqa: BLE001
                restore = None
                _session.fail("balancing a DataLoader", exc)
        original(self, *args, **kwargs)
        if restore is not None:
            for name, value in restore.items():  # what the script built stays visible: sampler, batch_size
                object.__setattr__(self, name, value)

    return __init__


def _wrap_iter_next(original: Callable) -> Callable:
    from memrt.balance.loader import note_consumed_inner

    @functools.wraps(original)
    def __next__(self):
        sess = _session.current()
        clock = sess.clock if sess is not None else None
        if clock is None:
            data = original(self)
        else:
            clock.data_begin()
            try:
                data = original(self)
            finally:
                clock.data_end()
        note_consumed_inner(self)
        return data

    return __next__


def _wrap_shard_iter(original: Callable) -> Callable:
    """accelerate's DataLoaderShard iterates its DataLoader one batch ahead: consumption is noted here."""
    from memrt.balance.loader import ShareSampler

    @functools.wraps(original)
    def __iter__(self):
        sampler = getattr(self.__dict__.get("base_dataloader"), "batch_sampler", None)
        if not isinstance(sampler, ShareSampler):
            yield from original(self)
            return
        sampler.outer = True
        for batch in original(self):
            sampler.note_consumed()
            yield batch

    return __iter__


def _wrap_backward(original: Callable) -> Callable:
    @functools.wraps(original)
    def backward(tensors, *args, **kwargs):
        sess = _session.current()
        if sess is not None and sess.balance is not None:
            sess.balance.observe_backward(tensors)
        return original(tensors, *args, **kwargs)

    return backward


def _wrap_fully_shard(original: Callable) -> Callable:
    @functools.wraps(original)
    def fully_shard(module, *args, **kwargs):
        sess = None
        if not _session.is_off():
            sess = _ensure_session()
        result = original(module, *args, **kwargs)
        if sess is not None and not _session.is_off():
            try:
                from memrt.activation.collector import freeze_setup
                from memrt.activation.wiring import note_fully_shard

                note_fully_shard(sess, module)
                freeze_setup(sess)
            except Exception as exc:  # noqa: BLE001
                _session.fail("FSDP2 set-up", exc)
        return result

    return fully_shard
