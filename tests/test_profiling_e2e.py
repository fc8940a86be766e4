"""A real 2-rank gloo run records collectives and a training loop; `memrt report` merges the rank files.

Each rank times its collectives twice in the same loop: with ``memrt.profiling.comm_log.timed`` (what
the report shows) and independently with ``perf_counter`` around each call. The report's figures must be
the means of what the recorder timed, and the recorder's time of each call must hold the independent one
and agree with it within 10% (a call the operating system preempts between the two clocks may differ:
at most 2% of the calls).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memrt.testing import run_processes

SIZES_BYTES = (4096, 65536, 1048576)
ITERS = 20
STEPS = 3
N_LAYER = 3


class SavedBytes:
    """CPU live bytes of a training step, estimated: parameters + gradients + optimizer state, plus the
    bytes each unit saved for backward (deduplicated by storage, parameters excluded) until that unit's
    backward has run. Hooks are registered before the UnitMarker's so its reads see the update."""

    def __init__(self, model, optimizer, units):
        import torch

        self.model, self.optimizer = model, optimizer
        self.params = {p.data_ptr() for p in model.parameters()}
        self.saved: dict[str, int] = {}
        self.seen: set[int] = set()
        self.current = None
        for name, mod in units:
            mod.register_forward_pre_hook(lambda m, a, n=name: setattr(self, "current", n))
            mod.register_forward_hook(lambda m, a, o: setattr(self, "current", None))
            mod.register_full_backward_hook(lambda m, gi, go, n=name: self.saved.__setitem__(n, 0))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if self.current is not None and ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.saved[self.current] = self.saved.get(self.current, 0) + t.untyped_storage().nbytes()
        return t

    def fixed(self) -> int:
        tensors = {}
        for p in self.model.parameters():
            tensors[p.data_ptr()] = p.untyped_storage().nbytes()
            if p.grad is not None:
                tensors[p.grad.data_ptr()] = p.grad.untyped_storage().nbytes()
        for state in self.optimizer.state.values():
            for v in state.values():
                if hasattr(v, "untyped_storage"):
                    tensors[v.data_ptr()] = v.untyped_storage().nbytes()
        return sum(tensors.values())

    def __call__(self) -> int:
        return self.fixed() + sum(self.saved.values())

    def new_step(self):
        self.saved.clear()
        self.seen.clear()


class Momentum:
    """SGD with momentum, by hand: torch.optim's constructor imports torch._dynamo (seconds per process)."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        self.params, self.lr, self.beta = list(params), lr, beta
        self.state: dict = {}

    def step(self):
        import torch

        with torch.no_grad():
            for p in self.params:
                buf = self.state.setdefault(p, {"momentum_buffer": torch.zeros_like(p)})["momentum_buffer"]
                buf.mul_(self.beta).add_(p.grad)
                p.add_(buf, alpha=-self.lr)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _rank_run(rank, world, out_dir):
    import torch
    import torch.distributed as dist

    from memrt.profiling import UnitMarker, get_recorder, memrt_range, timed
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    rec = get_recorder()
    rec.clear()
    rec.configure(enabled=True, exact_timing=False)
    rec.set_meta(world_size=world, purpose="test_profiling_e2e")
    independent: dict[str, list[float]] = {}
    recorded: dict[str, list[float]] = {}

    def both(op, tensor, call, *, late=False, **kw):
        if late and rank == 1:
            time.sleep(0.003)  # rank 1 arrives late: the straggler view must name it
        # The independent clock brackets the collective itself, not the recorder's own bookkeeping
        # (a GC pause while a record is created would otherwise count as collective time).
        with timed(op, tensor, None, "flat", **kw):
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
        key = f"{op}/{kw.get('nbytes', tensor.numel() * tensor.element_size())}"
        independent.setdefault(key, []).append(t1 - t0)
        recorded.setdefault(key, []).append(rec.comm[-1].seconds)

    for _ in range(ITERS):
        for nbytes in SIZES_BYTES:
            x = torch.full((nbytes // 4,), float(rank))
            both("all_reduce", x, lambda: dist.all_reduce(x), late=True, redop=dist.ReduceOp.SUM)
            both("broadcast", x, lambda: dist.broadcast(x, 0), late=True)
            out = torch.empty(nbytes // 4 * world)
            both("all_gather", out, lambda: dist.all_gather_into_tensor(out, x), late=True)

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=N_LAYER, d_model=64, n_head=4, seq_len=32, vocab_size=128)
    model = GPT(cfg)
    opt = Momentum(model.parameters())
    units = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    live = SavedBytes(model, opt, units)
    marker = UnitMarker(units, live_bytes=live)
    fixed_at_start = []
    for step in range(STEPS):
        x, y = gpt_batch(cfg, 4, seed=step)
        live.new_step()
        fixed_at_start.append(live.fixed())
        with marker.step(step):
            with live.hooks:
                loss = lm_loss(model(x), y)
            kept = dict(live.saved)  # bytes each unit saved for backward (what a plan's 'keep' holds)
            marker.phase("backward")
            loss.backward()
            with memrt_range("grad_sync"):  # eight equal buckets, like DDP's gradient buckets
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                for bucket in flat[: flat.numel() // 8 * 8].chunk(8):
                    both("all_reduce", bucket, lambda: dist.all_reduce(bucket), redop="sum")
            marker.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
    rec.add_plan({"units": [{"name": n, "action": "keep", "bytes_kept": kept[n], "bytes_freed": 0,
                             "bytes_moved": 0, "added_seconds": 0.0} for i, (n, _) in enumerate(units)],
                  "budget_bytes": int(max(fixed_at_start) * 4), "predicted_peak_bytes": None,
                  "measured_peak_bytes": None})
    rec.write(out_dir, rank)
    marker.remove()
    param_bytes = sum({p.data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())
    return {"independent": independent, "recorded": recorded, "fixed_at_start": fixed_at_start, "param_bytes": param_bytes}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("memrt-report")
    results = run_processes(_rank_run, 2, str(d), timeout=120)
    return d, results


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_two_ranks_report_tables_json_pngs_and_traces(run_dir, capsys):
    from memrt.cli import main

    d, results = run_dir
    assert sorted(p.name for p in d.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert main(["report", str(d)]) == 0
    text = capsys.readouterr().out
    for needle in ("== memory", "== collectives", "size(B)", "busbw(GB/s)", "# all_reduce  algorithm=flat  ranks=2",
                   "== plan per unit", "== stragglers", "likely straggler: rank 1"):
        assert needle in text, needle
    report = json.loads((d / "report.json").read_text())
    assert report["ranks"] == [0, 1] and report["problems"] == []

    # comm rows: all ops and sizes present, nccl-tests maths on the merged rows
    rows = {(r["op"], r["size_bytes"]): r for r in report["comm"]["rows"]}
    for nbytes in SIZES_BYTES:
        for op, size in (("all_reduce", nbytes), ("broadcast", nbytes), ("all_gather", 2 * nbytes)):
            r = rows[(op, size)]
            assert r["calls"] == 2 * ITERS and r["ranks"] == 2 and r["count"] == size // 4
            assert r["algbw_gbps"] == pytest.approx(size / (r["time_us"] * 1e-6) / 1e9)
            factor = {"all_reduce": 1.0, "broadcast": 1.0, "all_gather": 0.5}[op]
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
    assert rows[("all_reduce", SIZES_BYTES[0])]["redop"] == "sum"

    # the report's figures are the means of the recorder's timings, per rank and merged over the ranks
    for rank, res in enumerate(results):
        for row in report["comm"]["per_rank"][str(rank)]:
            times = res["recorded"][f"{row['op']}/{row['size_bytes']}"]
            assert row["time_us"] == pytest.approx(sum(times) / len(times) * 1e6, rel=1e-6), (rank, row)
    for (op, size), row in rows.items():
        means = [sum(v) / len(v) * 1e6 for v in (res["recorded"][f"{op}/{size}"] for res in results)]
        assert row["time_us"] == pytest.approx(sum(means) / 2, rel=1e-6), row
    # each call's recorded time holds the independent perf_counter timing of the same call and agrees with it
    # within 10%, but for the few calls preempted between the two clocks
    for rank, res in enumerate(results):
        pairs = [(key, r, i) for key in res["independent"]
                 for r, i in zip(res["recorded"][key], res["independent"][key], strict=True)]
        assert all(r >= i for _, r, i in pairs), rank
        apart = [(key, r * 1e6, i * 1e6) for key, r, i in pairs if r - i > 0.10 * i]
        assert len(apart) <= 0.02 * len(pairs), (rank, len(pairs), apart)

    # stragglers: rank 1 sleeps before each collective of the loop (180 of 192 calls), so it enters last
    stragglers = {s["rank"]: s for s in report["comm"]["stragglers"]}
    assert stragglers[1]["last_arrivals"] > stragglers[0]["last_arrivals"], stragglers
    assert stragglers[1]["mean_lateness_us"] > 1000, stragglers  # ~3 ms late on 180 calls of 192

    # memory: steps, fixed vs activation, peak at the end of the last block's forward
    for rank, res in enumerate(results):
        mem = report["memory"][str(rank)]
        assert len(mem["steps"]) == STEPS
        assert [s["fixed_bytes"] for s in mem["steps"]] == res["fixed_at_start"]
        assert mem["steps"][0]["fixed_bytes"] == res["param_bytes"]  # no grads/optimizer state yet
        assert mem["steps"][1]["fixed_bytes"] >= 2 * res["param_bytes"]  # momentum buffers appeared
        # the peak: entering the last block's backward, all saved activations still alive and the
        # gradients of the head (tied embedding) already allocated
        peak = mem["peak"]
        assert peak["unit"] == f"blocks.{N_LAYER - 1}" and peak["phase"] == "backward"
        assert peak["activation_bytes"] == peak["live_bytes"] - peak["fixed_bytes"] > 0

    # PNGs: real images of the sizes plots.py promises
    assert _png_size(d / "memory_timeline.png") == (1000, 450)
    assert _png_size(d / "comm_time.png") == (900, 450)
    assert _png_size(d / "plan.png") == (900, max(300, 60 + 22 * N_LAYER))

    # Chrome trace: every event has ph/ts/dur/pid/tid, complete events are sane, memrt ranges present
    trace = json.loads((d / "trace.json").read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= e.keys(), e
        assert e["ph"] in {"X", "C", "i", "M"}
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"memrt::all_reduce", "memrt::broadcast", "memrt::all_gather", "memrt::step", "memrt::grad_sync",
            "memrt::blocks.0.forward", "memrt::blocks.0.backward"} <= names
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e["ph"] == "C" and "live_bytes" in e["args"] for e in events)
    per_rank = json.loads((d / "trace_rank1.json").read_text())["traceEvents"]
    assert {e["pid"] for e in per_rank} == {1}


@pytest.mark.slow
def test_report_survives_a_truncated_and_a_corrupt_rank_file(run_dir, tmp_path):
    d, _ = run_dir
    for name in ("rank0.json", "rank1.json"):
        shutil.copy(d / name, tmp_path / name)
    text = (tmp_path / "rank1.json").read_text()
    (tmp_path / "rank1.json").write_text(text[: len(text) // 2])  # killed while writing
    (tmp_path / "rank2.json").write_text('{"rank": 2, "memory": [] "comm": []}')  # corrupt
    (tmp_path / "rank3.json").write_text('{"hello": 1}')  # not memrt's
    proc = subprocess.run([sys.executable, "-m", "memrt", "report", str(tmp_path), "--no-plots"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "rank1.json: truncated JSON" in proc.stderr and "rank1.json" in proc.stdout
    assert "rank3.json: not a memrt rank file" in proc.stderr
    assert "rank2.json: corrupt JSON" in proc.stderr
    assert "== collectives" in proc.stdout and "# all_reduce" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ranks"] == [0]
    assert sorted(Path(p["path"]).name for p in report["problems"]) == ["rank1.json", "rank2.json", "rank3.json"]
    assert report["comm"]["rows"] and report["memory"]["0"]["peak"] is not None

    # no usable file at all: a clear error, exit status 2
    (tmp_path / "rank0.json").write_text("")
    proc = subprocess.run([sys.executable, "-m", "memrt", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nothing to report" in proc.stderr and "rank0.json" in proc.stderr
