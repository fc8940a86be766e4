"""The steps of benchmarks/gpu_check.py, each run in its own process: ``step_<name>(out) -> (status, reason, figures)``.

    python -m benchmarks.gpu_check --step offload_budgets --out DIR     # one step alone (writes DIR/logs/<step>.json)

Timings come from steps after warm-up (medians, CUDA synchronised); arms are rebuilt from the same seed
and the device is cleaned between them (del, gc, ``empty_cache``, peak stats reset), so one arm's
memory is never counted against the next one's budget.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["step_imports", "step_offload_budgets", "step_offload_overlap", "step_nccl", "step_mixed_cluster",
           "step_pytest_gpu"]

ROOT = Path(__file__).resolve().parent.parent
BATCH = 8
WARM, TIMED = 2, 3


def step_imports(out: Path) -> tuple[str, str, dict]:
    """memrt, memrt.comm, memrt.profiling and the benchmarks import in a fresh process (the install works)."""
    import importlib

    mods = ["memrt", "memrt.comm", "memrt.comm.streams", "memrt.profiling", "memrt.memory.offload.host",
            "benchmarks.offload", "benchmarks.mixed_cluster"]
    where = {}
    for m in mods:
        where[m] = str(Path(importlib.import_module(m).__file__).relative_to(ROOT))
    import memrt

    return "PASS", f"{len(mods)} modules import from {ROOT.name} (memrt {memrt.__version__})", where


# ------------------------------------------------------------------------------------------------ offload
def _gpt():
    import torch

    from memrt.testing.models import GPT, GPTConfig, gpt_batch

    cfg = GPTConfig(vocab_size=256, seq_len=1024, n_layer=12, d_model=512, n_head=8, dropout=0.1)
    torch.manual_seed(0)
    return GPT(cfg).cuda(), gpt_batch(cfg, BATCH, device="cuda")


def _clean() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _step(model, batch, forward: Callable | None, seed: int) -> float:
    import torch

    from memrt.testing.models import lm_loss

    x, y = batch
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every arm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    lm_loss((forward or model)(x), y).backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _measure(model, batch, forward: Callable | None = None, *, warm: int = WARM) -> dict[str, Any]:
    """Warm-up steps, then one step at seed 1 (peaks, gradients), then TIMED timed steps."""
    import torch

    for i in range(warm):
        _step(model, batch, forward, 100 + i)
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, batch, forward, 1)
    peak_alloc, peak_res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    times = [_step(model, batch, forward, 200 + i) for i in range(TIMED)]
    return {"peak_allocated": int(peak_alloc), "peak_reserved": int(peak_res), "grads": grads,
            "step_s": statistics.median(times)}


def _blockwise(model, ckpt: bool):
    import torch
    from torch.utils.checkpoint import checkpoint

    def fwd(idx):
        x = model.drop(model.tok(idx) + model.pos(torch.arange(idx.size(1), device=idx.device)))
        for b in model.blocks:
            x = checkpoint(b, x, use_reentrant=False) if ckpt else b(x)
        return model.head(model.ln_f(x))
    return fwd


def _on_cpu(model):
    import torch

    def fwd(idx):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return model(idx)
    return fwd


def _pinned_bytes(model) -> int | None:
    """Pinned pool bytes of the model's offload engines (None when they cannot be found)."""
    from types import SimpleNamespace

    from benchmarks.offload import _engines

    try:
        return sum(e.stats().host_pool_capacity_bytes for e in _engines(SimpleNamespace(model=model)))
    except Exception:  # noqa: BLE001 - a figure, not a check
        return None


def _memrt_arm(label: str, budget: int, offload: str | None, ref: list, baseline: dict) -> dict[str, Any]:
    import torch

    import memrt

    model, batch = _gpt()
    memrt.auto(model, budget=budget, offload=offload)
    try:
        m = _measure(model, batch, warm=3)  # profile, plan in force, one more
        plan = memrt.plan_of(model)
        actions = sorted({str(u.action) for u in plan.units}) if plan is not None else []
        predicted = getattr(plan, "predicted_peak_bytes", None)
        certified = getattr(plan, "measured_peak_bytes", None)  # what memrt's own certification measured
        pinned = _pinned_bytes(model)
    finally:
        memrt.disable(model)
    equal = all(torch.equal(a, b) for a, b in zip(ref, m["grads"]))
    arm = {"arm": f"memrt@{label}", "budget": int(budget), "peak_allocated": m["peak_allocated"],
           "peak_reserved": m["peak_reserved"], "step_s": m["step_s"], "grads_equal": equal,
           "vs_every_block": m["step_s"] / baseline["every_block"], "vs_save_on_cpu": m["step_s"] / baseline["save_on_cpu"],
           "pinned_bytes": pinned, "predicted_peak": predicted, "certified_peak": certified,
           "actions": ",".join(actions)}
    why = []
    if not equal:
        why.append("gradients differ from stock")
    if m["peak_allocated"] > budget:
        why.append(f"allocated {m['peak_allocated']} > budget")
    if m["peak_reserved"] > budget:
        why.append(f"reserved {m['peak_reserved']} > budget")
    if offload == "host" and not any("offload_host" in a for a in actions):
        why.append(f"the plan did not use host offload ({arm['actions']})")
    arm["status"] = "FAIL" if why else "PASS"
    arm["why"] = "; ".join(why)
    del model, batch
    _clean()
    return arm


def _min_budget() -> tuple[int | None, str]:
    """budget=1: the BudgetError comes from the forward after the profiling step; its smallest feasible budget."""
    import memrt

    model, batch = _gpt()
    try:
        try:
            memrt.auto(model, budget=1)
        except memrt.BudgetError as exc:
            return int(exc.min_feasible_bytes), "BudgetError from memrt.auto itself"
        for i in range(3):
            try:
                _step(model, batch, None, 300 + i)  # step 1 profiles; the next forward plans and raises
            except memrt.BudgetError as exc:
                return int(exc.min_feasible_bytes), f"BudgetError in the forward of step {i + 1}"
        return None, "budget=1 byte ran 3 steps without a BudgetError"
    finally:
        memrt.disable(model)
        del model, batch
        _clean()


def step_offload_budgets(out: Path) -> tuple[str, str, dict]:
    import torch

    import memrt

    torch.use_deterministic_algorithms(True, warn_only=True)
    arms: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    ref: list = []
    for name in ("stock", "stock_again", "every_block", "save_on_cpu"):
        model, batch = _gpt()
        fwd = {"stock": None, "stock_again": None, "every_block": _blockwise(model, True),
               "save_on_cpu": _on_cpu(model)}[name]
        m = _measure(model, batch, fwd)
        if name == "stock":
            ref = m["grads"]
        equal = all(torch.equal(a, b) for a, b in zip(ref, m["grads"]))
        base[name] = m["step_s"]
        arms.append({"arm": name, "peak_allocated": m["peak_allocated"], "peak_reserved": m["peak_reserved"],
                     "step_s": m["step_s"], "grads_equal": equal})
        del model, batch, fwd, m
        _clean()
    keep, ckpt = arms[0]["peak_allocated"], arms[2]["peak_allocated"]
    deterministic = arms[1]["grads_equal"]
    for label, budget, offload in (("90%", int(0.9 * keep), None), ("60%", int(0.6 * keep), None),
                                   ("0.9x_every_block", int(0.9 * ckpt), "host")):
        try:
            arms.append(_memrt_arm(label, budget, offload, ref, base))
        except Exception as exc:  # noqa: BLE001 - one arm's error is its row, the next arm still runs
            arms.append({"arm": f"memrt@{label}", "budget": budget, "status": "FAIL",
                         "why": f"{type(exc).__name__}: {str(exc)[:200]}"})
            _clean()
    smallest, how = _min_budget()
    if smallest is None:
        arms.append({"arm": "memrt@min", "status": "FAIL", "why": how})
    else:
        # The planner's smallest budget counts allocated bytes; certification measures reserved ones. A
        # user told "raise MEMRT_BUDGET to at least X" by certification's BudgetError does so once.
        tries: list[str] = []
        arm = None
        for _ in range(2):
            try:
                arm = _memrt_arm("min", smallest, None, ref, base)
                arm["why"] = "; ".join(w for w in (arm["why"], how, *tries) if w)
                break
            except memrt.BudgetError as exc:
                tries.append(f"{smallest} bytes: BudgetError at certification, smallest {exc.min_feasible_bytes}")
                smallest = int(exc.min_feasible_bytes)
                _clean()
            except Exception as exc:  # noqa: BLE001
                tries.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                break
        else:
            tries.append("no certified plan after 2 budgets")
        arms.append(arm or {"arm": "memrt@min", "budget": smallest, "status": "FAIL",
                            "why": "; ".join([how, *tries])})
    bad = [a for a in arms if a.get("status") == "FAIL"]
    note = "" if deterministic else " (stock vs stock differs too: CUDA nondeterminism, see arm stock_again)"
    reason = (f"{len(arms) - 4 - len(bad)}/{len(arms) - 4} memrt arms fit with bitwise gradients; keep-all "
              f"{keep / 2**30:.2f} GiB, every block {ckpt / 2**30:.2f} GiB" + note)
    if bad:
        reason += "; " + "; ".join(f"{a['arm']}: {a['why']}" for a in bad)
    return ("FAIL" if bad else "PASS"), reason, {"arms": arms, "deterministic_stock": deterministic}


def step_offload_overlap(out: Path) -> tuple[str, str, dict]:
    """benchmarks/offload.py's CUDA measure: every block to the host tier vs keep-all, same seeds."""
    from benchmarks.offload import cuda_overlap
    from memrt.testing.models import GPTConfig

    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)  # parameters are compared bitwise
    cfg = GPTConfig(vocab_size=256, seq_len=1024, n_layer=12, d_model=512, n_head=8, dropout=0.1)
    r = cuda_overlap(cfg, BATCH, rounds=3)
    allocs = r["pinned_allocations_per_step"]
    why = []
    if r["params_max_abs_diff"] != 0:
        why.append(f"parameters differ from keep-all by {r['params_max_abs_diff']:g}")
    if len(set(allocs[1:])) > 1:
        why.append(f"pinned allocations grow after step 1: {allocs}")
    reason = (f"hidden {r['hidden_share']:.0%} of {r['copy_seconds_per_step'] * 1e3:.1f} ms copies/step "
              f"(goal >= 70%); pinned {r['host_pool_capacity_bytes'] / 2**20:.0f} MiB, allocations {allocs}")
    return ("FAIL" if why else "PASS"), "; ".join(why + [reason]), r


# ------------------------------------------------------------------------------------------------ NCCL
NCCL_SIZES = (1, 7, 1000003)


def _nccl_worker(kind: str = "cuda") -> None:
    """One of 4 ranks on the one GPU (launched by step_nccl); prints ``RESULT {json}`` on rank 0.

    ``kind="cpu"``: the same checks on gloo with CPU tensors (a smoke test of this code off the GPU)."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import memrt.comm as dist

    dev = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks: dict[str, bool] = {}
    for numel in NCCL_SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(-8, 8, (numel,), generator=g).to(dtype).to(dev)
            ref = x.clone()
            tdist.all_reduce(ref)
            dist.all_reduce(x)  # small integers: every reduction order gives the same sum
            checks[f"all_reduce {numel} {str(dtype)[6:]}"] = bool(torch.equal(x, ref))
    for src in (0, 3):
        b = torch.full((1000003,), float(rank), device=dev)
        dist.broadcast(b, src=src)
        checks[f"broadcast from {src}"] = bool(torch.all(b == src).item())
    algos = sorted({r.algorithm for r in _records()})

    def train(hook: bool) -> list:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(dev)
        ddp = DDP(model, device_ids=[0] if kind == "cuda" else None, bucket_cap_mb=1)
        if hook:
            dist.register_ddp_hook(ddp, compress="none")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(2):
            xb = torch.randn(32, 64, generator=g).to(dev)
            opt.zero_grad(set_to_none=True)
            ddp(xb).square().mean().backward()
            opt.step()
        if kind == "cuda":
            torch.cuda.synchronize()
        return [p.detach().cpu() for p in model.parameters()]

    plain, memrt_hook = train(False), train(True)
    diff = max(float((a - b).abs().max()) for a, b in zip(plain, memrt_hook))
    checks["DDP hook 2 steps ~ plain DDP (rtol 1e-5)"] = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, memrt_hook))
    topo = dist.get_topology()
    if rank == 0:
        print("RESULT " + json.dumps({"checks": checks, "world": world, "nodes": [list(n) for n in topo.nodes],
                                      "algorithms": algos, "ddp_max_abs_diff": diff,
                                      "links": str(topo.links)[:300]}), flush=True)
    dist.destroy_process_group()


def _records() -> list:
    from memrt.profiling.recorder import get_recorder

    rec = get_recorder()
    rec.resolve_pending(block=True)
    return list(rec.comm)


def step_nccl(out: Path, kind: str = "cuda") -> tuple[str, str, dict]:
    from benchmarks._common import launch_on_nodes, result_lines

    env = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier", "MEMRT_REPORT_DIR": str(out / "logs"),
           "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
           "NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "0"}
    outs = launch_on_nodes(["python", "-m", "benchmarks.gpu_steps", "--nccl-worker", kind], nodes=((0, 1), (2, 3)),
                           env=env, timeout_s=55 if kind == "cuda" else 240,
                           rank_env=lambda r: {"NCCL_HOSTID": f"memrt-gpu-check-{r}"})
    r = result_lines(outs)[0]
    bad = [k for k, ok in r["checks"].items() if not ok]
    reason = (f"{len(r['checks']) - len(bad)}/{len(r['checks'])} equal to torch.distributed "
              f"(algorithms {','.join(r['algorithms'])}; DDP max |diff| {r['ddp_max_abs_diff']:g})")
    if "hier" not in r["algorithms"]:
        bad.append("hierarchical algorithm never ran")
    return ("FAIL" if bad else "PASS"), reason + ("; failed: " + ", ".join(bad) if bad else ""), r


# ------------------------------------------------------------------------------------------------ others
def _child(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    return p.returncode, (p.stdout + p.stderr)


def step_mixed_cluster(out: Path) -> tuple[str, str, dict]:
    rc, text = _child([sys.executable, "-m", "benchmarks.mixed_cluster", "--gpu-check"], 35)
    (out / "logs" / "mixed_cluster.out").write_text(text)
    last = " | ".join(text.strip().splitlines()[-3:])
    if "SKIP" in text and rc == 0:
        return "SKIP", last[-300:], {}
    return ("PASS" if rc == 0 else "FAIL"), last[-300:], {"rc": rc}


def step_pytest_gpu(out: Path) -> tuple[str, str, dict]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "SKIP", "pytest is not installed on this machine (no network to install it)", {}
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in f.read_text())  # only these: other modules may need packages absent here
    if not files:
        return "FAIL", "no test module carries the gpu marker", {}
    rc, text = _child([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files], 65)
    (out / "logs" / "pytest_gpu.out").write_text(text)
    summary = next((ln for ln in reversed(text.strip().splitlines()) if " in " in ln and ("passed" in ln or
                    "failed" in ln or "skipped" in ln or "error" in ln)), text.strip()[-200:])
    if rc == 5:
        return "FAIL", "no test carries the gpu marker", {}
    if rc == 0 and "passed" not in summary:
        return "FAIL", f"no gpu test ran (CUDA not seen by pytest?): {summary.strip('= ')}", {"rc": rc, "files": files}
    return ("PASS" if rc == 0 else "FAIL"), summary.strip("= "), {"rc": rc, "files": files}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--nccl-worker"]:
        _nccl_worker(*sys.argv[2:3])
    else:
        sys.exit("usage: python -m benchmarks.gpu_check --step NAME --out DIR (this module holds the steps)")
