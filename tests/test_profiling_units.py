"""memrt.profiling without processes: nccl-tests maths, timing modes, timeline attribution, ranges, traces."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest
import torch

from memrt.profiling import (CommRecord, Recorder, UnitMarker, analyze_memory, busbw_factor, chrome_trace,
                             memrt_range, summarize_comm, timed)
from memrt.profiling import comm_log, plots, report


@pytest.fixture
def rec():
    r = Recorder()
    yield r


def _rec(op="all_reduce", nbytes=1 << 20, seconds=1e-3, n=4, start=0.0, **kw):
    return CommRecord(op=op, dtype="float32", nbytes=nbytes, group_size=n, algorithm="flat", seconds=seconds,
                      start=start, **kw)


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert busbw_factor("all_gather_into_tensor", 4) == pytest.approx(3 / 4)
    assert busbw_factor("all_to_all", 2) == pytest.approx(1 / 2)
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == 1.0
    assert busbw_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError):
        busbw_factor("all_reduce", 0)


def test_summary_rows_merge_ranks_by_mean_and_print_in_nccl_tests_order():
    per_rank = {0: [_rec(seconds=1e-3), _rec(seconds=3e-3), _rec(nbytes=4096, seconds=1e-4)],
                1: [_rec(seconds=4e-3), _rec(seconds=4e-3, predicted_seconds=2e-3)]}
    rows = summarize_comm(per_rank)
    big = next(r for r in rows if r.size_bytes == 1 << 20)
    assert big.time_us == pytest.approx((2e-3 + 4e-3) / 2 * 1e6)  # mean of the ranks' means
    assert big.calls == 4 and big.ranks == 2 and big.count == (1 << 20) // 4
    assert big.algbw_gbps == pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert big.busbw_gbps == pytest.approx(big.algbw_gbps * 1.5)
    assert big.predicted_us == pytest.approx(2000.0)
    small = next(r for r in rows if r.size_bytes == 4096)
    assert small.ranks == 1 and small.time_us == pytest.approx(100.0)
    table = comm_log.format_comm_table(rows)
    header = next(line for line in table.splitlines() if "size(B)" in line).split()
    assert header[:7] == ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]
    assert table.splitlines()[0] == "# all_reduce  algorithm=flat  ranks=4"


def test_straggler_view_names_the_rank_that_enters_last():
    ranks = []
    for rank, delay in ((0, 0.0), (1, 0.002), (2, 0.0005)):
        comm = [CommRecord(op="all_reduce", dtype="float32", nbytes=64, group_size=3, algorithm="flat",
                           seconds=0.003 - delay, start=100.0 + i + delay) for i in range(5)]
        ranks.append({"rank": rank, "t0_unix": 1000.0, "t0_perf": 100.0,
                      "comm": [asdict(c) for c in comm]})
    spreads, stragglers = comm_log.straggler_view(ranks)
    by = {s.rank: s for s in stragglers}
    assert by[1].last_arrivals == 5 and by[0].last_arrivals == 0
    assert by[1].mean_lateness_us == pytest.approx(2000.0) and by[2].mean_lateness_us == pytest.approx(500.0)
    assert spreads[0].spread_us == pytest.approx(2000.0)
    assert "likely straggler: rank 1" in comm_log.format_straggler_table(spreads, stragglers)


def test_timed_on_cpu_records_one_call_and_nothing_when_off_or_failed(rec):
    t = torch.ones(256, dtype=torch.float16)
    with timed("all_reduce", t, algorithm="hier", redop=torch.distributed.ReduceOp.SUM, recorder=rec,
               tier_bytes={"inter": 128}):
        time.sleep(0.01)
    (r,) = rec.comm
    assert (r.op, r.dtype, r.nbytes, r.group_size, r.algorithm, r.redop) == ("all_reduce", "float16", 512, 1, "hier", "sum")
    assert 0.009 < r.seconds < 0.5 and r.tier_bytes == {"inter": 128} and r.start > 0
    with pytest.raises(RuntimeError):
        with timed("broadcast", t, recorder=rec):
            raise RuntimeError("collective failed")
    rec.configure(enabled=False)
    with timed("broadcast", t, recorder=rec):
        pass
    assert len(rec.comm) == 1


class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        self.t = None
        self.done = True

    def record(self, stream=None):
        self.t = time.perf_counter()
        _FakeEvent.log.append("record")

    def query(self):
        return self.done

    def synchronize(self):
        _FakeEvent.log.append("event_sync")

    def elapsed_time(self, end):
        return 7.0  # milliseconds


class _FakeCudaTensor:
    is_cuda = True
    dtype = torch.float32
    device = "cuda:0"

    def numel(self):
        return 1024

    def element_size(self):
        return 4


def test_cuda_timing_is_lazy_by_default_and_synchronizes_only_in_exact_mode(rec, monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    _FakeEvent.log.clear()
    with timed("all_reduce", _FakeCudaTensor(), recorder=rec, group_size=2):
        pass
    assert syncs == [] and _FakeEvent.log == ["record", "record"]
    assert rec.comm[0].seconds > 0 and len(rec._pending) == 1  # host time until resolved
    data = rec.to_dict(0)  # write() resolves pending events once
    assert data["comm"][0]["seconds"] == pytest.approx(0.007) and rec._pending == []

    rec.configure(exact_timing=True)
    with timed("all_reduce", _FakeCudaTensor(), recorder=rec, group_size=2):
        pass
    assert syncs == ["cuda:0", "cuda:0"] and len(rec._pending) == 0


def test_pending_resolution_does_not_wait_for_unfinished_events(rec):
    a, b = _FakeEvent(), _FakeEvent()
    b.done = False
    rec.record_comm_pending(_rec(seconds=0.0), a, b)
    assert rec.resolve_pending(block=False) == 1 and rec.comm[0].seconds == 0.0
    b.done = True
    assert rec.resolve_pending(block=False) == 0 and rec.comm[0].seconds == pytest.approx(0.007)


def _ev(t, live, kind, label=""):
    return {"t": t, "live_bytes": live, "kind": kind, "label": label}


def test_timeline_attributes_the_peak_to_unit_and_phase_and_splits_fixed_bytes():
    events = [
        _ev(0.0, 100, "step_begin"), _ev(0.1, 100, "unit_begin", "a"), _ev(0.2, 150, "unit_end", "a"),
        _ev(0.3, 150, "unit_begin", "b"), _ev(0.4, 210, "sample"), _ev(0.5, 200, "unit_end", "b"),
        _ev(0.55, 260, "sample"),  # logits/loss: outside units
        _ev(0.6, 260, "unit_begin", "b"),  # b again: backward by the heuristic
        _ev(0.65, 280, "recompute", "b"), _ev(0.7, 220, "unit_end", "b"), _ev(0.8, 120, "step_end"),
        _ev(1.0, 130, "step_begin"), _ev(1.1, 130, "phase", "forward"), _ev(1.2, 500, "unit_begin", "b@forward"),
        _ev(1.3, 140, "unit_end", "b@forward"), _ev(1.4, 140, "phase", "optimizer"), _ev(1.5, 300, "sample"),
        _ev(1.6, 135, "step_end"),
    ]
    tl = analyze_memory(events)
    s0, s1 = tl.steps
    assert (s0.fixed_bytes, s0.peak_bytes, s0.peak_unit, s0.peak_phase) == (100, 280, "b", "backward")
    assert s0.activation_peak_bytes == 180 and s0.actions == {"recompute": 1}
    assert (s1.fixed_bytes, s1.peak_bytes, s1.peak_unit, s1.peak_phase) == (130, 500, "b", "forward")
    assert tl.peak.live_bytes == 500 and tl.peak.step == 1 and tl.peak.activation_bytes == 370
    outside = [p for p in tl.points if p.t_s == 0.55][0]
    assert outside.unit == "(outside units)" and outside.phase == "forward"
    assert [p.phase for p in tl.points if p.t_s == 1.5] == ["optimizer"]
    assert analyze_memory(events, fixed_bytes=50).peak.activation_bytes == 450
    assert analyze_memory([]).peak is None


def test_memrt_range_records_as_context_manager_and_decorator(rec, monkeypatch):
    import memrt.profiling.trace as trace_mod

    monkeypatch.setattr(trace_mod, "get_recorder", lambda: rec)

    @memrt_range("planner.solve", units=3)
    def solve(n):
        return solve(n - 1) + 1 if n else 0  # recursion: one range per call

    with memrt_range("offload.pack"):
        assert solve(2) == 2
    names = [e.name for e in rec.trace]
    assert names.count("memrt::planner.solve") == 3 and names[-1] == "memrt::offload.pack"
    assert rec.trace[0].args == {"units": 3}
    rec.configure(enabled=False)
    with memrt_range("off"):
        pass
    assert len(rec.trace) == 4


@pytest.mark.slow  # torch.profiler imports torch._dynamo (~4 s here)
def test_memrt_ranges_show_inside_a_users_torch_profiler_trace(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    model = GPT(cfg)
    x, y = gpt_batch(cfg, 2)
    with UnitMarker(model, live_bytes=lambda: 0) as marker, profile(activities=[ProfilerActivity.CPU]) as prof:
        with marker.step(0):
            with memrt_range("user.section"):
                lm_loss(model(x), y).backward()
    path = tmp_path / "user_trace.json"
    prof.export_chrome_trace(str(path))
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"memrt::user.section", "memrt::blocks.0.forward", "memrt::blocks.1.forward"} <= names
    assert marker.names == ["blocks.0", "blocks.1"]
    assert not model.blocks[0]._forward_hooks  # the context removed the hooks


def test_chrome_trace_of_a_recorder_has_complete_events_and_a_memory_counter(rec):
    t = time.perf_counter()
    rec.record_trace("memrt::plan", t, t + 0.001, units=4)
    rec.record_memory(1000, "step_begin")
    rec.record_memory(5000, "offload", "blocks.1")
    rec.record_comm(_rec(start=time.perf_counter()))
    events = chrome_trace(rec.to_dict(3))["traceEvents"]
    assert all({"ph", "ts", "dur", "pid", "tid"} <= e.keys() and e["pid"] == 3 for e in events)
    xs = {e["name"]: e for e in events if e["ph"] == "X"}
    assert xs["memrt::plan"]["dur"] == pytest.approx(1000, rel=1e-6) and xs["memrt::all_reduce"]["cat"] == "comm"
    assert [e["args"]["live_bytes"] for e in events if e["ph"] == "C"] == [1000, 5000]
    assert any(e["ph"] == "i" and e["name"] == "memrt::offload blocks.1" for e in events)


def test_add_plan_accepts_dicts_json_and_plan_objects(rec):
    class FakePlan:
        def to_json(self):
            return json.dumps({"units": [], "budget_bytes": 7})

    rec.add_plan({"units": []})
    rec.add_plan('{"units": [], "budget_bytes": 5}')
    rec.add_plan(FakePlan())
    assert [p.get("budget_bytes") for p in rec.plans] == [None, 5, 7]


def test_report_without_matplotlib_still_writes_text_and_json_and_says_how(rec, tmp_path, monkeypatch):
    rec.record_memory(10, "step_begin")
    rec.record_memory(30, "sample")
    rec.record_comm(_rec())
    rec.write(tmp_path, 0)
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    data, text = report.write_report(tmp_path)
    assert 'pip install "memrt[plot]"' in text and not list(tmp_path.glob("*.png"))
    assert json.loads((tmp_path / "report.json").read_text())["memory"]["0"]["peak"]["live_bytes"] == 30
    assert "# all_reduce" in (tmp_path / "report.txt").read_text()


def test_report_of_a_missing_directory_says_what_to_pass(tmp_path):
    from memrt.errors import MemrtError

    with pytest.raises(MemrtError, match="MEMRT_REPORT_DIR"):
        report.load_rank_files(tmp_path / "nope")


def test_unit_marker_marks_forward_then_backward_in_reverse_order(rec):
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=3, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    model = GPT(cfg)
    x, y = gpt_batch(cfg, 2)
    live = iter(range(10**6))
    with UnitMarker(model, live_bytes=lambda: next(live) * 100, recorder=rec) as marker:
        with marker.step(0):
            lm_loss(model(x), y).backward()
        with torch.no_grad():  # no graph: forward marks only, nothing left open
            model(x)
    marks = [(e.kind, e.label) for e in rec.memory]
    fwd = [m for b in range(3) for m in (("unit_begin", f"blocks.{b}@forward"), ("unit_end", f"blocks.{b}@forward"))]
    bwd = [m for b in (2, 1, 0) for m in (("unit_begin", f"blocks.{b}@backward"), ("unit_end", f"blocks.{b}@backward"))]
    assert marks == [("step_begin", "0"), *fwd, *bwd, ("step_end", "0"), *fwd]
    assert [e.name for e in rec.trace][:7] == [f"memrt::blocks.{b}.forward" for b in range(3)] + \
        [f"memrt::blocks.{b}.backward" for b in (2, 1, 0)] + ["memrt::step"]
    tl = analyze_memory(rec.memory)
    assert (tl.peak.unit, tl.peak.phase) == ("blocks.2", "forward")  # the last (highest) mark: the eval forward
    assert tl.peak.live_bytes == max(e.live_bytes for e in rec.memory) and tl.steps[0].peak_unit == "blocks.2"
    with pytest.raises(ValueError, match="live_bytes"):
        UnitMarker(model)  # CPU: no allocator statistics, the error says what to pass


def test_downsampled_timeline_keeps_each_steps_peak():
    events = [_ev(0.0, 0, "step_begin")] + [_ev(i * 1e-3, (i * 7919) % 1000 + (10**6 if i == 777 else 0), "sample")
                                            for i in range(1, 3000)]
    d = analyze_memory(events).to_dict(max_points=100)
    assert len(d["points"]) <= 102 and max(p["live_bytes"] for p in d["points"]) == d["peak"]["live_bytes"]


def test_unit_marker_skips_backward_marks_it_could_not_close(rec):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with UnitMarker(net, live_bytes=lambda: 0, recorder=rec) as marker:
        net(torch.ones(2, 4)).sum().backward()  # the first unit's input needs no grad
        assert all(not v for v in marker._open.values())  # nothing left open (no dangling ranges)
    labels = [e.label for e in rec.memory]
    assert labels == ["0@forward", "0@forward", "1@forward", "1@forward", "1@backward", "1@backward"]


@pytest.mark.gpu
def test_cuda_events_time_real_work_without_synchronize(rec, monkeypatch):
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    real_sync, syncs = torch.cuda.synchronize, []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device) or real_sync(device))
    for _ in range(3):
        with timed("all_reduce", a, recorder=rec, group_size=1):
            for _ in range(10):
                a = a @ a / 45.25  # keeps the scale (sqrt(2048))
    assert syncs == [] and len(rec._pending) == 3  # default mode: nothing waited for
    data = rec.to_dict(0)
    event_s = [c["seconds"] for c in data["comm"]]
    rec.clear()
    rec.configure(exact_timing=True)
    with timed("all_reduce", a, recorder=rec, group_size=1):
        for _ in range(10):
            a = a @ a / 45.25
    assert len(syncs) == 2 and not rec._pending
    exact_s = rec.comm[0].seconds
    assert all(s > 0 for s in event_s)
    assert min(event_s) == pytest.approx(exact_s, rel=0.25)  # both see the GPU work (10 matmuls)
