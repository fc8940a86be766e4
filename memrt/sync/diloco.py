"""``MEMRT_SYNC=diloco``: exact within a node every step, an outer optimizer step across nodes every H steps.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105), with a node's ranks as one DiLoCo worker:

- Inner steps. A DDP comm hook averages each gradient bucket over this node's ranks only (a process group
  per node, made with ``torch.distributed.new_group`` by every rank for every node in node order). With a
  registered hook DDP leaves the division to the hook (``default_hooks.allreduce_hook`` divides by the
  group's size itself), so the hook divides by the node's size: the node's ranks keep one replica, as
  stock DDP's ranks do, and the job's optimizer steps it. Nothing crosses nodes.
- Outer steps, after inner steps ``every``, ``2 * every``, ... (an optimizer step post-hook counts them):
  ``delta = anchor - params`` (anchor: the parameters at the last outer step, host memory), averaged across
  nodes weighted by the samples each node processed this round, then :class:`~memrt.sync.outer.OuterSGD`
  (Nesterov, lr 0.7, momentum 0.9 by default): ``params = anchor - update``; ``anchor = params``.

The weighted average in one SUM all-reduce. Rank ``r`` of node ``n`` contributes ``delta_r * w_r / W``
where ``w_r`` is the samples it counted (:meth:`DiLoCo.count_samples`; by default one per inner step, i.e.
equal per-rank batches) and ``W = sum_r w_r`` (a float64 all-reduce of one number; without counted samples
every rank's ``w_r`` is the fragment's inner steps, the same everywhere, so ``W = steps * world_size``
without a collective: the same float64 the all-reduce would give, an integer). The ranks of node ``n``
hold one replica (the hook above), so ``delta_r = delta_n`` for each of them and their contributions add up
to ``delta_n * (sum_{r in n} w_r) / W = delta_n * w_n / W``: the sum over every rank is the node average
``sum_n w_n delta_n / W`` weighted by each node's samples, whatever the node sizes. (It is the same as each
rank sending ``delta_n * w_n / k_n / W`` with ``k_n`` ranks per node when the node's ranks count equally.)
Every rank then holds the same sum and applies the same outer step to the same anchor and momentum, so
every rank holds the same model after each outer step, bitwise.

With every = 1, outer lr 1 and momentum 0 this is DDP over all ranks for an inner optimizer linear in the
gradient (SGD, with or without momentum): the weighted average of one SGD step from one anchor is the SGD
step on the average gradient (the tests check it).

Memory: the anchor and the momentum buffer are float32 in host memory (pinned for CUDA parameters), plus a
pinned staging buffer on CUDA; :meth:`DiLoCo.summary` reports their bytes. An outer step briefly holds up to
two float32 copies of a fragment's parameters on their device (the outer gradient and the anchor).

Schedule: the outer step works per :class:`~memrt.sync.outer.Fragment` (parameters with their own anchor,
momentum and schedule offset); fragment ``i`` takes its outer steps after the inner steps ``t > 0`` with
``(t - offset_i) % every == 0``.

- ``fragments=1`` (``MEMRT_SYNC_FRAGMENTS=1``, the default): one fragment at offset 0, its exchange run at
  once, blocking, after the inner step that ends a round.
- ``fragments=K > 1``: Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
  communication", arXiv:2501.18512). The trainable parameters, in module order, form K contiguous fragments
  of about equal elements (:func:`~memrt.sync.outer.split_parameters`; no tensor split), fragment ``i`` at
  offset ``round(i * every / K)``, so the exchanges spread over the round and each sends about 1/K of the
  model (the peak bandwidth drops K times; the bytes per round stay the model's). After the inner step ``t``
  that ends fragment ``i``'s round its weighted delta is computed and its exchange *started* (an async
  all-reduce); the optimizer post-hook of the next inner step ``t + 1`` waits for it, makes the outer step
  on the anchor and writes the new parameters into the fragment, before that step's own exchanges start, so
  the exchange overlaps step ``t + 1``'s forward and backward. Writing the global parameters over the fragment
  discards the fragment's one local inner step since the exchange started (Streaming DiLoCo's mixing factor
  alpha = 0): every rank then holds the same fragment after its outer step, as with K = 1; the fragment's
  next round starts after step ``t + 1`` (that step's samples are dropped with it). A user-supplied
  ``outer_all_reduce`` runs blocking at ``t`` and the rest still happens at ``t + 1`` (the same maths);
  :meth:`DiLoCo.finish` and :meth:`DiLoCo.state_dict` wait for a pending exchange first. Memory: the
  pending delta (float32, one fragment) stays on the parameters' device through step ``t + 1``.

Checkpoints between outer steps: nodes then hold different replicas, so a checkpoint saved mid-round holds
*that node's* replica (model, inner optimizer) together with :meth:`DiLoCo.state_dict` (anchor, momentum,
inner-step counter, this round's weight). Resume each rank from its own node's files, loading the model
state after wrapping it in DDP (DDP's construction broadcasts rank 0's parameters to every rank). A
checkpoint saved right after an outer step (or after :meth:`DiLoCo.finish`) is the same on every rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as tdist

from memrt.config import MemrtConfig, load_config
from memrt.errors import ConfigError
from memrt.sync.outer import Fragment, OuterSGD, fragment_offsets, make_fragment, split_parameters

__all__ = ["DiLoCo", "NodeMeanState", "attach", "node_mean_hook"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
"""Version of :meth:`DiLoCo.state_dict`'s layout."""

OuterAllReduce = Callable[[torch.Tensor, Any], Any]
"""``outer_all_reduce(tensor, group)``: an in-place SUM all-reduce of ``tensor`` over ``group``."""

Exchange = Callable[[torch.Tensor, Any], Any]
"""What :class:`DiLoCo` runs: an in-place SUM all-reduce that returns a handle to ``wait()`` on, or None when done."""


class NodeMeanState:
    """What :func:`node_mean_hook` needs: this rank's node group and its size."""

    __slots__ = ("group", "size")

    def __init__(self, group: Any, size: int) -> None:
        self.group = group
        self.size = size


def node_mean_hook(state: NodeMeanState, bucket):  # no annotations: DDP rejects any but GradBucket/Future
    """DDP comm hook: the bucket averaged over this node's ranks (sum / node size), nothing across nodes."""
    tensor = bucket.buffer()
    if state.size == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    tensor.div_(state.size)  # as torch's allreduce_hook: divide first (no fp16 overflow in the sum)
    work = tdist.all_reduce(tensor, group=state.group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _exact_all_reduce(tensor: torch.Tensor, group: Any) -> None:
    tdist.all_reduce(tensor, group=group)


def _exact_all_reduce_async(tensor: torch.Tensor, group: Any) -> Any:
    return tdist.all_reduce(tensor, group=group, async_op=True)


def _compressed(codec: str, async_op: bool = False) -> Exchange:
    def all_reduce(tensor: torch.Tensor, group: Any) -> Any:
        from memrt.comm import all_reduce as memrt_all_reduce

        return memrt_all_reduce(tensor, group=group, async_op=async_op, compress=codec)

    return all_reduce


def _blocking(fn: OuterAllReduce) -> Exchange:
    def all_reduce(tensor: torch.Tensor, group: Any) -> None:
        fn(tensor, group)  # whatever it returns: done when it returns

    return all_reduce


class _Pending:
    """A fragment's outer exchange started after the inner step that ended its round (``fragments > 1``)."""

    __slots__ = ("frag", "delta", "work")

    def __init__(self, frag: Fragment, delta: torch.Tensor, work: Any) -> None:
        self.frag, self.delta, self.work = frag, delta, work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def _replica_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of a replicated model; a sharded one (FSDP1, FSDP2, DTensor) is refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    if isinstance(module, FullyShardedDataParallel) or any(isinstance(p, DTensor) for p in params):
        raise ConfigError("MEMRT_SYNC", "diloco", "exact for a model with sharded parameters (FSDP, DTensor): "
                          "diloco takes a DDP model or a plain module (one replica per rank)")
    if not params:
        raise ValueError("memrt.sync: the model has no trainable parameters: nothing to synchronize")
    return params


def _node_groups(topology: Any) -> Any:
    """One process group per node, made by every rank for every node in node order (``new_group``'s rule);
    returns this rank's."""
    mine = None
    for node in topology.nodes:
        group = tdist.new_group(ranks=list(node))
        if topology.rank in node:
            mine = group
    return mine


def _weighted_delta(frag: Fragment, group: Any, world: int) -> torch.Tensor:
    """This rank's share of the nodes' weighted average of ``anchor - params`` (a new float32 tensor on the
    parameters' device): ``delta * w / W``, ``w`` its samples (or steps) this round and ``W`` their sum over the
    ranks (collective only when samples were counted: otherwise every rank's weight is the same step count)."""
    device = frag.device
    weight = frag.samples if frag.counted else float(frag.steps)
    if frag.counted:
        total = torch.tensor([weight], dtype=torch.float64, device=device)
        tdist.all_reduce(total, group=group)
        total_weight = float(total.item())
    else:
        total_weight = float(frag.steps * world)
    if not total_weight > 0:
        raise RuntimeError(f"memrt.sync: no samples counted on any rank this round (total weight "
                           f"{total_weight}): count_samples must be called on every rank or on none")
    delta = frag.flat()
    anchor = frag.anchor if device.type == "cpu" else frag.anchor.to(device, non_blocking=True)
    delta.neg_().add_(anchor)  # anchor - params
    del anchor
    return delta.mul_(weight / total_weight)


class DiLoCo:
    """DiLoCo on a DDP model (or a plain module and its process group): see the module's docstring.

    Collective: every rank of the group constructs it, with the same topology and settings. Usually made
    by :func:`attach`, which also decides whether it is needed.

    ``model``: a ``DistributedDataParallel`` (its comm hook is registered here: call before its first
    backward, and on a model without another hook) or a plain module, whose parameters are then broadcast
    from rank 0 and whose gradients are averaged within the node before each optimizer step.
    ``optimizer``: the job's (inner) optimizer over the model's parameters. ``topology``: a
    :class:`memrt.comm.Topology` whose nodes are the ranks of ``process_group`` (default: the DDP model's,
    else the default group), which must span every rank. ``every``: inner steps per outer step.
    ``compress``: codec of the outer exchange through :func:`memrt.comm.all_reduce` (bf16, fp16, int8, auto;
    no error feedback), None or "none" exact. ``outer_all_reduce``: replaces the exchange (``(tensor, group)``,
    in-place SUM, blocking), e.g. a compressed one; it wins over ``compress``. ``fragments``: K parameter
    fragments streamed at staggered offsets, their exchanges overlapped with the next inner step
    (``MEMRT_SYNC_FRAGMENTS``; 1 <= K <= every and K <= the trainable parameter tensors; 1: all at once, blocking).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, topology: Any, *, every: int = 50,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 process_group: Any = None, compress: str | None = None,
                 outer_all_reduce: OuterAllReduce | None = None, fragments: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} is not valid: expected a positive whole number of inner steps "
                             "(MEMRT_SYNC_EVERY)")
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        params = _replica_parameters(model.module if ddp else model)  # before any collective: fails on every rank
        most = min(every, len(params))
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= most:
            raise ValueError(f"fragments={fragments!r} is not valid (MEMRT_SYNC_FRAGMENTS): expected a whole number "
                             f"in [1, {most}]: at most every={every} (one exchange per inner step) "
                             f"and at most the model's {len(params)} trainable parameter tensors (none is split)")
        self.outer = OuterSGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self.every = every
        self.topology = topology
        if process_group is None:
            process_group = model.process_group if ddp else tdist.group.WORLD
        self.group = process_group
        world = tdist.get_world_size(process_group)
        if world != tdist.get_world_size() or world != topology.world_size:
            raise ValueError(f"DiLoCo needs its process group to span every rank and match the topology: group of "
                             f"{world} ranks, {tdist.get_world_size()} in the job, {topology.world_size} in "
                             f"nodes={topology.nodes!r}")
        if topology.rank != tdist.get_rank():
            raise ValueError(f"topology.rank={topology.rank} is not this process's rank {tdist.get_rank()}")
        self.compress = None if compress in (None, "none") else compress
        streamed = fragments > 1
        if outer_all_reduce is not None:
            self._exchange: Exchange = _blocking(outer_all_reduce)
        elif self.compress is not None:
            from memrt.comm.compress import check_compress

            check_compress(self.compress, "compress")
            self._exchange = _compressed(self.compress, async_op=streamed)
        else:
            self._exchange = _exact_all_reduce_async if streamed else _exact_all_reduce
        self.params = tuple(params)
        self.node_size = len(topology.nodes[topology.node_index])
        self.node_group = _node_groups(topology)
        self._handles: list[Any] = []
        if ddp:
            model.register_comm_hook(NodeMeanState(self.node_group, self.node_size), node_mean_hook)
        else:
            src = 0 if process_group is tdist.group.WORLD else tdist.get_global_rank(process_group, 0)
            with torch.no_grad():  # one model on every rank to start from, as DDP's construction makes it
                for p in params:
                    tdist.broadcast(p.data, src=src, group=process_group)
            self._handles.append(optimizer.register_step_pre_hook(self._average_grads_in_node))
        self.fragments: list[Fragment] = [
            make_fragment(group, offset=offset, momentum=self.outer.momentum > 0)
            for group, offset in zip(split_parameters(params, fragments), fragment_offsets(fragments, every))]
        self.streamed = streamed
        """K > 1: each exchange is started after the step that ends its round and finished in the next step."""
        self._pending: list[_Pending] = []
        self._world = world
        self._handles.append(optimizer.register_step_post_hook(self._after_inner_step))
        self.inner_steps = 0
        """Inner (optimizer) steps since construction (or as loaded by :meth:`load_state_dict`)."""
        self.outer_steps = 0
        """Outer steps done (each fragment's exchange counts once)."""
        self.outer_bytes_total = 0
        """Bytes this rank handed to the outer all-reduce, all outer steps together."""
        self.outer_bytes_last = 0
        """Bytes this rank handed to the last outer all-reduce (float32: 4 x the fragment's elements)."""
        logger.info("memrt.sync: diloco on node %d of %d (%d ranks), outer step every %d inner steps, outer "
                    "lr %g momentum %g%s, %d fragment(s), %d bytes of host memory", topology.node_index,
                    len(topology.nodes), self.node_size, every, outer_lr, outer_momentum,
                    " nesterov" if nesterov else "", fragments, self.host_bytes)

    # ---- what the job (or the activation) calls
    def count_samples(self, n: int | float) -> None:
        """Count ``n`` samples this rank processed (weights the nodes' average); call on every rank or on
        none: without it each inner step counts one sample per rank (equal per-rank batches)."""
        if n < 0:
            raise ValueError(f"n={n!r} is not valid: expected a number of samples >= 0")
        for frag in self.fragments:
            frag.samples += float(n)
            frag.counted = True

    def finish(self) -> None:
        """The job's end (collective): the pending exchange's outer step, if any, then an outer step (blocking)
        for every fragment with inner steps since its last one, so every rank ends with the same model.
        Training may go on afterwards."""
        self._finish_pending()
        for frag in self.fragments:
            if frag.steps > 0:
                self._outer_step(frag)

    def remove(self) -> None:
        """Remove the optimizer hooks (DDP's comm hook cannot be removed: the model keeps averaging within
        its node). Call :meth:`finish` first for one model on every rank."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def host_bytes(self) -> int:
        """Extra host memory of the outer state, bytes (anchor + momentum, + staging on CUDA)."""
        return sum(f.host_bytes for f in self.fragments)

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    @property
    def pending_exchanges(self) -> int:
        """Outer exchanges started and not yet applied (``fragments > 1``: at most one, between two steps)."""
        return len(self._pending)

    def summary(self) -> dict[str, Any]:
        """Values for the exit report (units in the names)."""
        return {
            "mode": "diloco", "every": self.every, "nodes": len(self.topology.nodes),
            "node_index": self.topology.node_index, "node_size": self.node_size,
            "outer_lr": self.outer.lr, "outer_momentum": self.outer.momentum, "nesterov": self.outer.nesterov,
            "compress": self.compress or "none", "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
            "outer_bytes_per_step": 4 * self.numel, "outer_bytes_last": self.outer_bytes_last,
            "outer_bytes_total": self.outer_bytes_total, "host_bytes": self.host_bytes,
            "parameters": self.numel, "fragments": len(self.fragments),
            "peak_outer_bytes": 4 * max(f.numel for f in self.fragments),
        }

    def state_dict(self) -> dict[str, Any]:
        """The sync state (copies on the CPU): anchor, momentum, counters, this round's weight, per fragment, and
        a pending exchange's reduced outer gradient (waited for here: the same on every rank), which
        :meth:`load_state_dict` restores to be applied after the next inner step, as without the interruption."""
        for pending in self._pending:
            pending.wait()
        return {
            "format": STATE_FORMAT, "every": self.every, "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps, "outer_bytes_total": self.outer_bytes_total,
            "fragments": [{"offset": f.offset, "numel": f.numel, "anchor": f.anchor.clone(),
                           "momentum": None if f.momentum is None else f.momentum.clone(), "steps": f.steps,
                           "samples": f.samples, "counted": f.counted} for f in self.fragments],
            "pending": [{"fragment": self.fragments.index(p.frag), "delta": p.delta.detach().to("cpu", copy=True)}
                        for p in self._pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (the model and the inner optimizer are restored by the job)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"sync state format {state.get('format')!r} is not valid: expected {STATE_FORMAT}")
        frags = state["fragments"]
        if [(f["offset"], f["numel"]) for f in frags] != [(f.offset, f.numel) for f in self.fragments]:
            raise ValueError("the sync state is of another model or fragment layout: fragments (offset, elements) "
                             f"{[(f['offset'], f['numel']) for f in frags]} saved, "
                             f"{[(f.offset, f.numel) for f in self.fragments]} here")
        for frag, saved in zip(self.fragments, frags):
            frag.anchor.copy_(saved["anchor"])
            if frag.momentum is not None:
                if saved["momentum"] is None:
                    frag.momentum.zero_()
                else:
                    frag.momentum.copy_(saved["momentum"])
            frag.steps, frag.samples, frag.counted = int(saved["steps"]), float(saved["samples"]), bool(saved["counted"])
        for pending in self._pending:  # an exchange of the state being replaced: let it end, then drop it
            pending.wait()
        self._pending = []
        for saved in state.get("pending", []):
            frag = self.fragments[saved["fragment"]]
            self._pending.append(_Pending(frag, saved["delta"].to(frag.device), None))
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self.outer_bytes_total = int(state["outer_bytes_total"])

    # ---- hooks
    def _average_grads_in_node(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Plain module: average the gradients over the node before the inner step (DDP's hook otherwise)."""
        if self.node_size == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.node_size)
        tdist.all_reduce(flat, group=self.node_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        for frag in self.fragments:
            frag.steps += 1
        self._finish_pending()  # started after the previous step: this step overlapped it, then is discarded
        for frag in self.fragments:
            if (self.inner_steps - frag.offset) % self.every == 0:
                if self.streamed:
                    self._pending.append(self._start_exchange(frag))
                else:
                    self._outer_step(frag)

    def _outer_step(self, frag: Fragment) -> None:
        """One fragment's outer step at once (collective, blocking)."""
        pending = self._start_exchange(frag)
        self._apply(pending)

    def _finish_pending(self) -> None:
        while self._pending:
            self._apply(self._pending.pop(0))

    def _start_exchange(self, frag: Fragment) -> _Pending:
        """Weighted ``anchor - params`` of ``frag`` handed to the exchange (collective); its round restarts."""
        with torch.no_grad():
            delta = _weighted_delta(frag, self.group, self._world)
            nbytes = delta.numel() * delta.element_size()  # this rank's contribution (before any compression)
            work = self._exchange(delta, self.group)
        self.outer_bytes_last = nbytes
        self.outer_bytes_total += nbytes
        frag.reset_round()
        return _Pending(frag, delta, work)

    def _apply(self, pending: _Pending) -> None:
        """Wait for the exchange, then OuterSGD on the anchor and the new parameters written into the fragment
        (over any inner step since the exchange started: alpha = 0)."""
        pending.wait()
        frag, delta = pending.frag, pending.delta
        with torch.no_grad():
            if frag.staging is not None:
                frag.staging.copy_(delta)
                delta = frag.staging
            self.outer.step(frag.anchor, frag.momentum, delta)  # the anchor is now the new parameters
            frag.write(frag.anchor)
        self.outer_steps += 1
        frag.reset_round()


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config: MemrtConfig | None = None,
           topology: Any = None, **options: Any) -> DiLoCo | None:
    """``MEMRT_SYNC=diloco`` on ``model`` (a DDP model, or a plain module) and its ``optimizer``, when it applies.

    Returns None and changes nothing when ``config.sync`` is ``exact`` (the default), when no process group
    is initialized, or when the topology has a single node; else a :class:`DiLoCo` (collective: call on every
    rank, after building the DDP model and its optimizer, before the first backward). Call its
    :meth:`~DiLoCo.finish` at the job's end. ``config``: default the environment's (``MEMRT_SYNC``,
    ``MEMRT_SYNC_EVERY``, ``MEMRT_SYNC_FRAGMENTS``, ``MEMRT_COMPRESS`` for the outer exchange). ``topology``:
    default :func:`memrt.comm.get_topology` (discovery, or ``MEMRT_TOPOLOGY``). ``options``: :class:`DiLoCo`'s
    keywords (``outer_lr``, ``outer_momentum``, ``nesterov``, ``process_group``, ``compress``,
    ``outer_all_reduce``, ``every`` over ``config.sync_every``, ``fragments`` over ``config.sync_fragments``).
    """
    config = config if config is not None else load_config(warn_unknown=False)
    if config.sync != "diloco":
        return None
    if topology is None:
        if not (tdist.is_available() and tdist.is_initialized()):
            logger.info("memrt.sync: MEMRT_SYNC=diloco but no process group: nothing to synchronize")
            return None
        from memrt.comm import get_topology

        topology = get_topology()
    if len(topology.nodes) < 2:
        logger.info("memrt.sync: MEMRT_SYNC=diloco on a single node: exact synchronization (stock)")
        return None
    options.setdefault("every", config.sync_every)
    options.setdefault("fragments", config.sync_fragments)
    if "compress" not in options and "outer_all_reduce" not in options:
        options["compress"] = config.compress
    return DiLoCo(model, optimizer, topology, **options)
