"""SpeedBalancer: the explicit API, a thin front over the parts ``MEMRT=1`` uses.

    bal = SpeedBalancer(global_batch=64)                      # after init_process_group
    loader = DataLoader(ds, batch_sampler=bal.sampler(ds))    # each rank: its share of every global batch
    ddp = DDP(model); bal.attach(ddp)                         # comm hook: grad * b_r/B, SUM all-reduce
    for x, y in loader:
        with bal.step(len(x)):                                # times compute; may rebalance at the end
            loss_fn(ddp(x), y).backward()                     # loss = mean over the rank's b_r samples
        opt.step(); opt.zero_grad()

Shares start uniform. Every ``rebalance_every`` steps all ranks exchange (samples/s, memory bound) through
the process group's store (:mod:`memrt.balance.exchange`, as ``MEMRT=1`` does) and run the same rule
(:func:`memrt.balance.decision.propose`); the new shares are adopted only when they cut the predicted step
time by ``min_gain`` (so noise does not make them flap), and take effect from the next global batch drawn — a
step boundary on every rank alike. Speeds: :class:`~memrt.balance.capability.ThroughputMeter`; gradients:
:func:`~memrt.balance.hook.weighted_allreduce_hook`; batches: the share sampler
(:class:`~memrt.balance.sampler.BalancedBatchSampler`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Sized

from memrt.balance.capability import ThroughputMeter, max_samples_from_plan
from memrt.balance.decision import propose
from memrt.balance.exchange import exchange_for_group
from memrt.balance.hook import WeightedHookState, weighted_allreduce_hook
from memrt.balance.sampler import BalancedBatchSampler
from memrt.balance.shares import Shares, decide_shares, uniform_shares

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.nn import Module
    from torch.nn.parallel import DistributedDataParallel

    from memrt.comm.mixed import MixedComm

__all__ = ["BalanceConfig", "Decision", "SpeedBalancer"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class BalanceConfig:
    """How a :class:`SpeedBalancer` measures and decides."""

    rebalance_every: int = 4
    """Steps between share decisions (one exchange of a few bytes per rank through the store each time)."""
    window_steps: int = 8
    """Steps in the throughput window (samples/s = the median of the window's per-step samples / compute
    seconds)."""
    warmup_steps: int = 1
    """Steps ignored after every share change (first-call and allocator warm-up)."""
    min_gain: float = 0.05
    """Adopt new shares only when they cut the predicted step time by this fraction (0.05 = 5%)."""
    adaptive: bool = True
    """False: keep the initial (or ``set_shares``) shares; no exchange is ever run."""
    exchange_timeout_s: float = 900.0
    """How long a rank waits for the others' figures at a decision (seconds)."""

    def __post_init__(self) -> None:
        if self.rebalance_every < 1:
            raise ValueError(f"rebalance_every={self.rebalance_every} is not valid: expected >= 1 step")
        if self.rebalance_every <= self.warmup_steps:
            raise ValueError(f"rebalance_every={self.rebalance_every} must exceed warmup_steps="
                             f"{self.warmup_steps}, or no step would be measured between decisions")
        if self.window_steps < 1:
            raise ValueError(f"window_steps={self.window_steps} is not valid: expected >= 1")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain={self.min_gain} is not valid: expected a fraction in [0, 1)")
        if self.exchange_timeout_s <= 0:
            raise ValueError(f"exchange_timeout_s={self.exchange_timeout_s} is not valid: expected seconds > 0")


@dataclass(kw_only=True, slots=True, frozen=True)
class Decision:
    """One share decision, identical on every rank."""

    step: int
    """Steps completed when it was taken."""
    samples_per_s: tuple[float, ...]
    """Exchanged measured throughput per rank."""
    max_samples: tuple[int | None, ...]
    """Exchanged memory bound per rank."""
    shares: tuple[int, ...]
    """Shares in force after the decision."""
    changed: bool
    """Whether the shares changed."""
    predicted_gain: float
    """1 - predicted step time with the proposal / with the old shares."""


class SpeedBalancer:
    """Speed-weighted data parallelism over ``group`` (default: the whole job) for a fixed global batch.

    Construction is collective (every rank of ``group``, same ``global_batch``): without ``shares`` the
    ranks exchange their memory bounds and start from uniform shares within them. ``max_samples`` is
    this rank's memory bound in samples per step (int), ``"plan"`` (derived from ``memrt.plan_of`` of the
    attached model at each decision) or None (unbounded).
    """

    def __init__(self, global_batch: int, *, group: ProcessGroup | None = None, max_samples: int | str | None = None,
                 config: BalanceConfig | None = None, shares: Sequence[int] | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("SpeedBalancer needs an initialized process group: call init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.config = config or BalanceConfig()
        if max_samples is not None and max_samples != "plan" and (not isinstance(max_samples, int) or max_samples < 1):
            raise ValueError(f"max_samples={max_samples!r} is not valid: expected samples >= 1, 'plan' (from "
                             "memrt.plan_of(model) of the attached model) or None (no memory bound)")
        self.max_samples = max_samples
        self._module: Module | None = None
        self.exchange = exchange_for_group(group, name="api", timeout_s=self.config.exchange_timeout_s)
        """Where the ranks' figures meet (the process group's store)."""
        if shares is None:  # uniform within the memory bounds: one exchange of the bounds
            bound = max_samples if isinstance(max_samples, int) else None
            bounds = [p["bound"] for p in self.exchange.gather({"sps": 1.0, "bound": bound})]
            self.shares = (uniform_shares(global_batch, self.world_size) if all(m is None for m in bounds)
                           else decide_shares(global_batch, [1.0] * self.world_size, bounds))
        else:
            self.shares = Shares(per_rank=tuple(shares), global_batch=global_batch)
        if len(self.shares.per_rank) != self.world_size:
            raise ValueError(f"shares={tuple(shares or ())} has {len(self.shares.per_rank)} entries for world size "
                             f"{self.world_size}")
        self.meter = ThroughputMeter(window_steps=self.config.window_steps, warmup_steps=self.config.warmup_steps)
        self.hook_state = WeightedHookState(weight=self.shares.weight(self.rank), world_size=self.world_size,
                                            group=group)
        self.decisions: list[Decision] = []
        self.steps = 0
        self._since_check = 0
        self._hook_attached = False
        self.comm = "none"
        """How gradients are reduced once attached: torch, memrt (topology-aware) or mixed (host staging)."""

    @property
    def global_batch(self) -> int:
        return self.shares.global_batch

    def sampler(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0) -> BalancedBatchSampler:
        """A batch sampler that follows this balancer's shares (pass as ``batch_sampler=``)."""
        return BalancedBatchSampler(data, self, shuffle=shuffle, seed=seed)

    def attach(self, ddp_model: DistributedDataParallel, *, comm: str = "auto",
               inner_hook: Callable[..., Any] | None = None, inner_state: Any = None, inner_averages: bool = True,
               mixed: MixedComm | None = None) -> WeightedHookState:
        """Register the weighted comm hook on a ``DistributedDataParallel`` model (collective: all ranks call it).

        ``comm``: "torch" reduces with torch.distributed; "memrt" with memrt.comm's topology-aware DDP hook
        (hierarchical on multi-node jobs); "auto" picks memrt.comm when it is installed and the job spans
        more than one node. An explicit ``inner_hook`` (which averages unless ``inner_averages=False``) wins;
        ``mixed`` (a ``memrt.comm.mixed.MixedComm``) stages through host memory for mixed device kinds.
        """
        if comm not in ("auto", "torch", "memrt"):
            raise ValueError(f"comm={comm!r} is not valid: expected 'auto', 'torch' or 'memrt'")
        if inner_hook is None and mixed is None and comm != "torch":
            inner_hook, inner_state = _memrt_comm_hook(ddp_model, required=comm == "memrt")
            inner_averages = True
        st = self.hook_state
        st.inner_hook, st.inner_state, st.inner_averages, st.mixed = inner_hook, inner_state, inner_averages, mixed
        self.comm = "mixed" if mixed is not None else ("memrt" if inner_hook is not None else "torch")
        try:
            ddp_model.register_comm_hook(st, weighted_allreduce_hook)
        except RuntimeError as exc:
            if "once" not in str(exc):
                raise
            raise RuntimeError("this DDP model already has a comm hook (MEMRT=1 registers memrt.comm's at "
                               "construction): build the DDP model without it and call attach(ddp, comm='memrt'), "
                               "which composes both") from exc
        self._hook_attached = True
        self._module = ddp_model.module
        # compute is timed from the module's own forward: DDP's buffer broadcast before it waits for peers
        self._module.register_forward_pre_hook(lambda _m, _args: st.note_forward())
        return st

    def memory_bound(self) -> int | None:
        """This rank's most samples per step: ``max_samples``, or from the memory plan when it is 'plan'."""
        if self.max_samples != "plan":
            return self.max_samples
        import memrt

        plan = memrt.plan_of(self._module) if self._module is not None else None

        if plan is None:
            return None
        try:
            return max_samples_from_plan(plan, self.shares.per_rank[self.rank])
        except ValueError as exc:  # never raise on one rank only: the others wait in the exchange
            logger.warning("rank %d: %s; bounding it at 1 sample per step", self.rank, exc)
            return 1

    def set_shares(self, per_rank: Sequence[int]) -> None:
        """Impose shares (every rank must call it with the same values at the same step boundary)."""
        self.shares = Shares(per_rank=tuple(per_rank), global_batch=self.global_batch)
        self.meter.reset()
        self._since_check = 0

    @contextlib.contextmanager
    def step(self, local_samples: int | None = None) -> Iterator[None]:
        """One training step's forward and backward. ``local_samples`` defaults to this rank's share."""
        n = self.shares.per_rank[self.rank] if local_samples is None else int(local_samples)
        start = time.perf_counter()
        self.hook_state.start_step(n / self.global_batch, start)
        yield
        end = time.perf_counter()
        compute = self.hook_state.compute_s if self.hook_state.compute_s is not None else end - start
        self.meter.add(n, compute)
        self.steps += 1
        self._since_check += 1
        if self.config.adaptive and self._since_check >= self.config.rebalance_every:
            self.rebalance()

    def rebalance(self) -> Decision:
        """The exchange, then the same decision on every rank. All ranks must call it."""
        self._since_check = 0
        mine = self.meter.samples_per_s()
        everyone = self.exchange.gather({"sps": mine if mine is not None else 0.0, "bound": self.memory_bound()})
        speeds = tuple(float(p["sps"]) for p in everyone)
        bounds = tuple(p["bound"] for p in everyone)
        old = self.shares
        new, gain = old, 0.0
        if all(s > 0 for s in speeds):
            proposal = propose(old, speeds, bounds)
            gain = proposal.gain
            if proposal.shares != old and (proposal.over or gain >= self.config.min_gain):
                new = proposal.shares
        decision = Decision(step=self.steps, samples_per_s=speeds, max_samples=bounds, shares=new.per_rank,
                            changed=new != old, predicted_gain=gain)
        self.decisions.append(decision)
        if decision.changed:
            self.shares = new
            self.meter.reset()
            logger.info("step %d: shares %s -> %s (samples/s %s, predicted step time -%.0f%%)", self.steps,
                        old.per_rank, new.per_rank, [f"{s:.1f}" for s in speeds], 100 * gain)
        return decision


def _memrt_comm_hook(ddp_model: DistributedDataParallel, *, required: bool) -> tuple[Callable[..., Any] | None, Any]:
    """(memrt.comm.ddp_comm_hook, its state) when wanted (``required``, or more than one node), else (None, None)."""
    import memrt.comm as mcomm

    hook, state_cls = mcomm.ddp_comm_hook, mcomm.DDPHookState
    param = next(iter(ddp_model.parameters()), None)
    device = param.device if param is not None else None  # NCCL: set-up collectives on this rank's device
    if not required:
        try:
            if mcomm.prepare(device).num_nodes <= 1:
                return None, None
        except Exception as exc:  # noqa: BLE001 - discovery trouble: reduce with torch.distributed instead
            logger.warning("memrt.comm topology unavailable (%s): reducing with torch.distributed", exc)
            return None, None
    else:
        mcomm.prepare(device)  # groups created and warmed now, not inside the first backward
    return hook, state_cls(process_group=ddp_model.process_group)
