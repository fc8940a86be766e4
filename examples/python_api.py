"""memrt's Python API used directly: ``memrt.auto`` for memory, ``memrt.comm`` for collectives (no MEMRT needed).

    torchrun --standalone --nproc-per-node 2 examples/python_api.py
    MEMRT_TOPOLOGY="0;1" torchrun --standalone --nproc-per-node 2 examples/python_api.py   # two nodes, faked

``memrt.comm.init_process_group`` is torch's, plus topology discovery; its collectives take torch.distributed's
arguments and choose flat or hierarchical per call. ``memrt.comm.register_ddp_hook`` routes DDP's gradient
all-reduce through them. ``memrt.auto(model, budget=...)`` plans which blocks keep, recompute or offload
their activations so a training step fits the budget; the first step measures, later steps run the plan,
and gradients are bitwise those of the model without memrt. ``memrt.plan_of`` shows the plan.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import memrt
import memrt.comm as dist


class Classifier(nn.Module):
    """A transformer encoder over token features, mean-pooled into 10 classes."""

    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", default="50MB",
                   help="memory budget of a training step (keep-all peak about 66 MB, smallest feasible about 39 MB)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = dist.get_topology()

    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)  # flat or hierarchical, whichever the cost model predicts faster
    if rank == 0:
        print(f"{topology.num_nodes} node(s), {topology.world_size} ranks; all_reduce -> {x.tolist()}", flush=True)

    torch.manual_seed(0)
    model = memrt.auto(Classifier(), budget=args.budget)
    ddp = DistributedDataParallel(model)
    dist.register_ddp_hook(ddp)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        inputs, labels = torch.randn(16, 64, 128, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = F.cross_entropy(ddp(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    plan = memrt.plan_of(model)
    if rank == 0:
        print(f"loss {loss.item():.4f}\n{plan if plan is not None else 'no plan'}", flush=True)
    dist.destroy_process_group()
    time.sleep(0.05)  # let gloo's worker threads free finished work before the interpreter shuts down


if __name__ == "__main__":
    main()
