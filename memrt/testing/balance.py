"""Side-by-side runs of stock DDP and speed-weighted DDP, for memrt's tests and benchmarks.

:func:`side_by_side` runs in every rank (e.g. through ``memrt.testing.run_processes``): it trains two
copies of one model from the same initial weights on the same global batches — stock DDP (default AVG
hook, ``DistributedSampler``, B/W samples per rank) and memrt's :class:`SpeedBalancer` — alternating
phases of ``phase_steps`` steps so that both see the same machine load, and returns per-mode seconds,
samples and final parameters. A slow rank comes from a CPU cap (``MEMRT_CPU_CAP``, root) or, without
root, from ``delay_s_per_sample`` (a sleep in forward proportional to the micro-batch).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DictStore", "Spec", "epochs_run", "make_dataset", "make_model", "reference_params", "side_by_side"]


@dataclass(kw_only=True, slots=True)
class Spec:
    """One side-by-side run (identical on every rank)."""

    global_batch: int = 32
    """B: samples per optimizer step over all ranks."""
    phase_steps: int = 6
    """Steps per timed phase of one mode."""
    phases: int = 3
    """Timed phases per mode (after one untimed warm-up phase per mode)."""
    width: int = 256
    """Hidden width of the MLP."""
    depth: int = 4
    """Hidden layers of the MLP."""
    in_features: int = 64
    n_classes: int = 10
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    modes: tuple[str, ...] = ("stock", "memrt")
    """Which of stock DDP / memrt to run."""
    shares: tuple[int, ...] | None = None
    """Initial memrt shares (None: uniform)."""
    adaptive: bool = True
    """Let the balancer re-decide shares from measurements."""
    rebalance_every: int = 3
    max_samples: dict[int, int] = field(default_factory=dict)
    """Rank -> memory bound in samples (per-rank budgets)."""
    delay_s_per_sample: dict[int, float] = field(default_factory=dict)
    """Rank -> seconds of sleep per sample in forward (slow-rank emulation without root)."""
    use_memrt_comm: bool = False
    """memrt mode reduces through memrt.comm's topology-aware DDP hook (else torch.distributed)."""
    bucket_cap_mb: float = 25.0

    @property
    def total_steps(self) -> int:
        return self.phase_steps * (self.phases + 1)


def make_model(spec: Spec):
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):  # seeded CPU init; the caller's generators do not move
        torch.default_generator.manual_seed(spec.seed)
        layers: list[nn.Module] = [nn.Linear(spec.in_features, spec.width), nn.ReLU()]
        for _ in range(spec.depth - 1):
            layers += [nn.Linear(spec.width, spec.width), nn.ReLU()]
        layers.append(nn.Linear(spec.width, spec.n_classes))
    return nn.Sequential(*layers)


def make_dataset(spec: Spec):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(spec.seed + 1)
    n = spec.global_batch * spec.total_steps
    x = torch.randn(n, spec.in_features, generator=g)
    y = torch.randint(0, spec.n_classes, (n,), generator=g)
    return TensorDataset(x, y)


def _optimizer(model, spec: Spec):
    import torch

    return torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)


def reference_params(spec: Spec, *, epochs: int = 1, steps_per_epoch: int | None = None) -> list:
    """Single-process training on the whole global batches, in the samplers' order (seed + epoch)."""
    import torch
    import torch.nn.functional as F

    model, ds = make_model(spec), make_dataset(spec)
    opt = _optimizer(model, spec)
    B = spec.global_batch
    for epoch in range(epochs):
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(spec.seed + epoch)).tolist()
        for k in range(len(ds) // B if steps_per_epoch is None else steps_per_epoch):
            x, y = ds[order[k * B:(k + 1) * B]]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _slow_forward(model, delay_per_sample: float):
    """Sleep ``delay_per_sample`` x micro-batch after each forward (inside the compute the balancer times)."""
    def post_hook(_module, args, _output):
        time.sleep(delay_per_sample * args[0].shape[0])

    model.register_forward_hook(post_hook)


def side_by_side(rank: int, world: int, spec_dict: dict) -> dict[str, Any]:
    """Train stock DDP and speed-weighted DDP alternately; every rank must call it. Returns figures and params."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from memrt.balance.balancer import BalanceConfig, SpeedBalancer
    from memrt.cluster.cpucap import cap_from_setting

    spec = Spec(**spec_dict)
    torch.set_num_threads(1)
    cap = cap_from_setting(rank)
    ds = make_dataset(spec)
    base = make_model(spec)
    B = spec.global_batch
    runners: dict[str, Any] = {}
    try:
        if "stock" in spec.modes:
            if B % world:
                raise ValueError(f"global_batch={B} is not divisible by world size {world}: stock DDP cannot run it")
            m = copy.deepcopy(base)
            if rank in spec.delay_s_per_sample:
                _slow_forward(m, spec.delay_s_per_sample[rank])
            ddp = DDP(m, bucket_cap_mb=spec.bucket_cap_mb)
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=spec.seed,
                                         drop_last=True)
            loader = DataLoader(ds, batch_size=B // world, sampler=sampler, drop_last=True)
            runners["stock"] = (m, ddp, _optimizer(m, spec), iter(loader), None)
        if "memrt" in spec.modes:
            m = copy.deepcopy(base)
            if rank in spec.delay_s_per_sample:
                _slow_forward(m, spec.delay_s_per_sample[rank])
            ddp = DDP(m, bucket_cap_mb=spec.bucket_cap_mb)
            bal = SpeedBalancer(B, max_samples=spec.max_samples.get(rank), shares=spec.shares,
                                config=BalanceConfig(rebalance_every=spec.rebalance_every, adaptive=spec.adaptive,
                                                     window_steps=spec.rebalance_every))
            bal.attach(ddp, comm="memrt" if spec.use_memrt_comm else "torch")
            loader = DataLoader(ds, batch_sampler=bal.sampler(ds, seed=spec.seed))
            runners["memrt"] = (m, ddp, _optimizer(m, spec), iter(loader), bal)

        seconds = {mode: 0.0 for mode in runners}
        samples = {mode: 0 for mode in runners}
        local_samples = {mode: [] for mode in runners}
        for phase in range(spec.phases + 1):
            order = list(runners) if phase % 2 == 0 else list(reversed(runners))
            for mode in order:
                m, ddp, opt, it, bal = runners[mode]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(spec.phase_steps):
                    x, y = next(it)
                    opt.zero_grad(set_to_none=True)
                    if bal is None:
                        F.cross_entropy(ddp(x), y).backward()
                    else:
                        with bal.step(len(x)):
                            F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    local_samples[mode].append(len(x))
                dist.barrier()
                if phase > 0:  # phase 0 warms both modes up, untimed
                    seconds[mode] += time.perf_counter() - t0
                    samples[mode] += spec.phase_steps * B
        bal = runners["memrt"][4] if "memrt" in runners else None
        return {
            "rank": rank,
            "seconds": seconds,
            "samples_per_s": {k: samples[k] / seconds[k] for k in seconds if seconds[k] > 0},
            "local_samples": local_samples,
            "params": {k: [p.detach().numpy().copy() for p in r[0].parameters()] for k, r in runners.items()},  # numpy: pickles by value
            "shares": None if bal is None else list(bal.shares.per_rank),
            "decisions": [] if bal is None else [asdict(d) for d in bal.decisions],
            "capped": cap is not None,
            "comm": None if bal is None else bal.comm,
        }
    finally:
        if cap is not None:
            cap.close()


def epochs_run(rank: int, world: int, spec_dict: dict, epochs: int = 2) -> dict[str, Any]:
    """memrt mode only, whole epochs through a plain ``for`` loop over the loader (uneven shares, any B)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from memrt.balance.balancer import BalanceConfig, SpeedBalancer

    spec = Spec(**spec_dict)
    torch.set_num_threads(1)
    ds, model = make_dataset(spec), make_model(spec)
    if rank in spec.delay_s_per_sample:
        _slow_forward(model, spec.delay_s_per_sample[rank])
    ddp = DDP(model)
    bal = SpeedBalancer(spec.global_batch, shares=spec.shares, max_samples=spec.max_samples.get(rank),
                        config=BalanceConfig(rebalance_every=spec.rebalance_every, adaptive=spec.adaptive))
    bal.attach(ddp, comm="memrt" if spec.use_memrt_comm else "torch")
    sampler = bal.sampler(ds, seed=spec.seed)
    loader = DataLoader(ds, batch_sampler=sampler)
    opt = _optimizer(model, spec)
    steps, local = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        n = 0
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            with bal.step(len(x)):
                F.cross_entropy(ddp(x), y).backward()
            opt.step()
            n += 1
            local.append(len(x))
        steps.append(n)
    return {"rank": rank, "steps_per_epoch": steps, "local_samples": local,
            "params": [p.detach().numpy().copy() for p in model.parameters()],
            "shares": list(bal.shares.per_rank), "decisions": [asdict(d) for d in bal.decisions], "comm": bal.comm}


class DictStore:
    """An in-process key-value store with the part of c10d's ``Store`` the balancer uses (set, get,
    delete_key, wait), for tests of one process: ``wait`` raises at once for a missing key instead of blocking."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, k: str, v: str | bytes) -> None:
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k: str) -> bytes:
        return self.d[k]

    def delete_key(self, k: str) -> bool:
        return self.d.pop(k, None) is not None

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        missing = [k for k in keys if k not in self.d]
        if missing:
            raise RuntimeError(f"missing {missing}")

