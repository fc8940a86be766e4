"""DDP + compression of the inter-node hop vs exact DDP: final loss of a GPT-style model.

Baseline, in the same run and the same processes: plain DDP (gloo all-reduce, exact). Arms: memrt's
DDP hook with ``compress="int8"`` with error feedback (the default) and, for contrast, without it
(the residual dropped every step); with ``--job sparse-rows`` also ``compress="bf16"``. 4 ranks on
loopback with MEMRT_TOPOLOGY=0,1;2,3 (two fake nodes, so the hook runs hierarchically and compresses
only the inter-node hop). Same seeds, same data.

Jobs: ``stream`` (default): a learnable token stream over the whole vocabulary. ``sparse-rows``: tied
embeddings, vocabulary 1024, every input drawn from a fixed 64-token subset, so most embedding rows get
all-zero gradients through the input and vanishing ones through the tied head (chunks of zeros and of
values whose int8 scale is a float32 subnormal); GPT d=512, 4 layers, 1 x 128 tokens per rank, AdamW.

    .venv/bin/python -m benchmarks.convergence_int8 [--quick] [--steps 200] [--job stream|sparse-rows]

--quick: a smaller model, 60 steps, no contrast arm.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from benchmarks._common import base_parser, machine_info, machine_line, print_table, write_json

TOPOLOGY = "0,1;2,3"


def _batch(cfg, batch: int, step: int, rank: int):
    """A learnable stream: x[t+1] = (3 x[t] + 7) mod V, with 10% of tokens replaced at random."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    seq = [start]
    for _ in range(cfg.seq_len):
        seq.append((3 * seq[-1] + 7) % cfg.vocab_size)
    data = torch.cat(seq, dim=1)
    noise = torch.rand(data.shape, generator=g) < 0.1
    data = torch.where(noise, torch.randint(0, cfg.vocab_size, data.shape, generator=g), data)
    return data[:, :-1], data[:, 1:]


SUBSET = 64
"""Tokens the sparse-rows job draws its inputs from."""


def _sparse_batch(cfg, batch: int, step: int, rank: int):
    """The stream of :func:`_batch` over a fixed subset of SUBSET tokens spread over the vocabulary."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(12345))[:SUBSET]
    start = torch.randint(0, SUBSET, (batch, 1), generator=g)
    seq = [start]
    for _ in range(cfg.seq_len):
        seq.append((3 * seq[-1] + 7) % SUBSET)
    idx = torch.cat(seq, dim=1)
    noise = torch.rand(idx.shape, generator=g) < 0.1
    idx = torch.where(noise, torch.randint(0, SUBSET, idx.shape, generator=g), idx)
    data = tokens[idx]
    return data[:, :-1], data[:, 1:]


def train(arm: str, steps: int, cfg_kw: dict[str, Any], batch: int, job: str = "stream") -> list[float]:
    """Train a fresh GPT for ``steps`` under DDP with ``arm`` in {exact, int8, int8-no-ef, bf16}; losses
    (global mean, through torch.distributed so that the logged value is exact)."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memrt.comm as dist
    from memrt.comm.compress import get_error_feedback
    from memrt.testing.models import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = DDP(GPT(cfg), bucket_cap_mb=1)
    if arm != "exact":
        dist.register_ddp_hook(model, compress=arm.split("-")[0])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ef = get_error_feedback()
    ef.clear()
    rank = tdist.get_rank()
    losses = []
    for step in range(steps):
        x, y = (_sparse_batch if job == "sparse-rows" else _batch)(cfg, batch, step, rank)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if arm == "int8-no-ef":
            ef.clear()  # contrast arm: what compression drops is lost every step
        t = loss.detach().clone()
        tdist.all_reduce(t)
        losses.append(t.item() / tdist.get_world_size())
    return losses


def _worker(rank: int, world: int, steps: int, cfg_kw: dict[str, Any], batch: int,
            arms: tuple[str, ...], job: str = "stream") -> dict[str, Any]:
    import torch

    from memrt.comm import api

    torch.set_num_threads(1)
    api.setup_topology(health=False)
    out = {}
    for arm in arms:
        t0 = time.perf_counter()
        out[arm] = {"losses": train(arm, steps, cfg_kw, batch, job), "seconds": time.perf_counter() - t0}
    return out


SPARSE_QUICK = dict(vocab_size=1024, seq_len=32, n_layer=2, n_head=2, d_model=64, dropout=0.0)
SPARSE_FULL = dict(vocab_size=1024, seq_len=128, n_layer=4, n_head=8, d_model=512, dropout=0.0)


def run(steps: int, quick: bool, job: str = "stream") -> dict[str, Any]:
    from memrt.testing import run_processes

    if job == "sparse-rows":
        cfg_kw, batch = (SPARSE_QUICK, 2) if quick else (SPARSE_FULL, 1)
        arms = ("exact", "int8", "bf16") if quick else ("exact", "int8", "bf16", "int8-no-ef")
    else:
        cfg_kw = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64, dropout=0.0) if quick else \
            dict(vocab_size=128, seq_len=64, n_layer=4, n_head=4, d_model=128, dropout=0.0)
        batch = 8
        arms = ("exact", "int8") if quick else ("exact", "int8", "int8-no-ef")
    res = run_processes(_worker, 4, steps, cfg_kw, batch, arms, job, env={"MEMRT_TOPOLOGY": TOPOLOGY},
                        timeout=3600)[0]
    return {"job": job, "model": cfg_kw, "batch_per_rank": batch, "steps": steps, "arms": arms, **res}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; 60 with --quick)")
    p.add_argument("--job", choices=("stream", "sparse-rows"), default="stream",
                   help="stream: tokens over the whole vocabulary; sparse-rows: inputs from 64 of 1024 tokens")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    args.steps = args.steps or (60 if args.quick else 200)
    info = machine_info()
    print(machine_line(info))
    res = run(args.steps, args.quick, args.job)
    tail = 10
    exact = sum(res["exact"]["losses"][-tail:]) / tail
    rows = []
    summary = {}
    for arm in res["arms"]:
        final = sum(res[arm]["losses"][-tail:]) / tail
        rel = (final - exact) / exact
        summary[arm] = {"final_loss": final, "rel_diff_vs_exact": rel,
                        "all_finite": all(math.isfinite(v) for v in res[arm]["losses"])}
        rows.append((arm, f"{res[arm]['losses'][0]:.4f}", f"{final:.4f}", f"{rel * 100:+.2f}%",
                     f"{res[arm]['seconds']:.1f} s"))
    print_table(["arm", "first loss", f"final loss (mean of last {tail})", "vs exact", "time"], rows,
                title=f"GPT {res['model']} ({res['job']}) DDP 2 nodes x 2 ranks (loopback), {res['steps']} steps")
    for arm in ("int8", "bf16"):
        if arm in summary:
            ok = abs(summary[arm]["rel_diff_vs_exact"]) <= 0.01 and summary[arm]["all_finite"]
            print(f"{arm}{' + error feedback' if arm == 'int8' else ''} ends "
                  f"{summary[arm]['rel_diff_vs_exact'] * 100:+.2f}% from exact after {res['steps']} steps "
                  f"({'within' if ok else 'NOT within'} 1%{'' if summary[arm]['all_finite'] else ', non-finite losses'})")
    no_ef = summary.get("int8-no-ef")
    if no_ef:
        print(f"without error feedback {no_ef['rel_diff_vs_exact'] * 100:+.2f}%")
    write_json(args.out, "convergence_int8", {"machine": info, "summary": summary, **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
