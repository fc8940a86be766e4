"""An unchanged DDP training script: it does not import memrt, it is what a team already has.

Small GPT-style model (dropout on), gloo, a DataLoader, N steps of AdamW; rank 0 saves the final
parameters. memrt's tests run it as it is:

    torchrun --nproc-per-node 2 --master-port 0 tests/scripts/ddp_train.py --steps 3 --out params.pt
    MEMRT=1 torchrun --nproc-per-node 2 --master-port 0 tests/scripts/ddp_train.py --steps 3 --out params.pt
    MEMRT=1 mpiexec -n 2 python tests/scripts/ddp_train.py --steps 3 --out params.pt

``--probe-dir`` makes each DataLoader worker write what it sees of memrt (module names, import hooks),
which the tests use to check that nothing of memrt runs in workers.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 32, 32, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


def probe_worker(probe_dir: str, worker_id: int) -> None:
    """DataLoader worker_init_fn: write what this worker process sees of memrt."""
    seen = {
        "pid": os.getpid(),
        "modules": sorted(m for m in sys.modules if m == "memrt" or m.startswith(("memrt.", "_memrt"))),
        "import_hooks": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("memrt")],
    }
    with open(os.path.join(probe_dir, f"worker-{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (spawned)")
    parser.add_argument("--probe-dir", default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank, LOCAL_RANK)")
    parser.add_argument("--backend", default="gloo", help="gloo, or nccl with --device cuda")
    args = parser.parse_args()

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":  # the usual order: pick the device, then init (no collective before it)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = Tokens(args.batch * world * args.steps)
    loader_kw = {}
    if args.workers:
        loader_kw = {"num_workers": args.workers, "multiprocessing_context": "spawn"}
        if args.probe_dir:
            loader_kw["worker_init_fn"] = functools.partial(probe_worker, args.probe_dir)
    loader = DataLoader(torch.utils.data.Subset(data, range(rank, len(data), world)), batch_size=args.batch,
                        **loader_kw)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, and must be replayed exactly
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's threads free finished work under the GIL: before exit, where torch aborts them


if __name__ == "__main__":
    main()
