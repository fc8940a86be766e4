"""CUDA / NCCL paths checked on CPU with fakes: the device memrt.comm's set-up and probe use, when discovery
runs, the order groups are warmed in, when a worker's collective counts as complete, the balance hook's
staging wait, and the offload engine's held-bytes total. What needs a GPU is a row of benchmarks/gpu_check.sh."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from memrt.comm import streams


class _FakeCuda:
    """Records the CUDA calls of memrt.comm.streams in order (no device needed)."""

    def __init__(self, monkeypatch, *, current: int = 0, count: int = 4) -> None:
        self.calls: list[tuple] = []
        self.current = current
        test = self

        class Event:
            def __init__(self, *a, **k) -> None:
                self.name = f"event{len([c for c in test.calls if c[0] == 'Event'])}"
                test.calls.append(("Event", self.name))

            def record(self, stream) -> None:
                test.calls.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                test.calls.append(("synchronize", self.name))

            def query(self) -> bool:
                return True

        class Stream:
            def __init__(self, device=None, name: str = "comm") -> None:
                self.name = name

            def wait_event(self, ev) -> None:
                test.calls.append(("wait_event", self.name, ev.name))

        @contextlib.contextmanager
        def stream_ctx(s):
            test.calls.append(("stream enter", s.name))
            yield
            test.calls.append(("stream exit", s.name))

        def set_device(d) -> None:
            test.current = torch.device(d).index if not isinstance(d, int) else d
            test.calls.append(("set_device", test.current))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: test.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(name="caller"))
        monkeypatch.setattr(streams, "_streams", {})


def test_group_device_follows_the_backend(monkeypatch):
    _FakeCuda(monkeypatch, current=2)
    monkeypatch.setattr(streams, "is_nccl", lambda group=None: True)
    assert streams.group_device() == torch.device("cuda", 2)  # NCCL: CUDA tensors on the current device
    monkeypatch.setattr(streams, "is_nccl", lambda group=None: False)
    assert streams.group_device() == torch.device("cpu")  # gloo / MPI: the CPU


def test_setup_device_order(monkeypatch):
    fake = _FakeCuda(monkeypatch, current=0, count=2)
    monkeypatch.setattr(streams, "is_nccl", lambda group=None: True)
    assert streams.setup_device("cuda:1", local_rank=0) == torch.device("cuda", 1)  # the collective's tensor
    assert streams.setup_device(None, device_id=torch.device("cuda", 1), local_rank=0) == torch.device("cuda", 1)
    assert streams.setup_device(None, local_rank=3) == torch.device("cuda", 1)  # LOCAL_RANK modulo visible GPUs
    fake.current = 1  # the script called set_device
    assert streams.setup_device(None, local_rank=0) == torch.device("cuda", 1)
    monkeypatch.setattr(streams, "is_nccl", lambda group=None: False)
    assert streams.setup_device("cuda:1") is None  # gloo: no CUDA device for set-up collectives


def test_submission_completes_after_the_gpu_work(monkeypatch):
    """The worker binds its thread to the tensor's device, waits for the caller's stream, runs on memrt's
    stream and returns only after the work's end event completed (so the future follows completion)."""
    fake = _FakeCuda(monkeypatch, current=0)
    tensor = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    sub = streams.DeviceSubmission(tensor)  # on the caller's thread
    ran = []
    out = sub.run(lambda: (ran.append(len(fake.calls)), fake.calls.append(("fn",)))[1])
    names = [c[0] for c in fake.calls]
    assert out is None and ran
    assert names == ["Event", "record", "set_device", "wait_event", "stream enter", "fn", "Event", "record",
                     "stream exit", "synchronize"], fake.calls
    assert fake.calls[1] == ("record", "event0", "caller")  # the caller's stream, at submission
    assert fake.calls[2] == ("set_device", 1) and fake.calls[3] == ("wait_event", "comm", "event0")
    assert fake.calls[-1] == ("synchronize", "event1")  # the end event, recorded on memrt's stream
    cpu = streams.DeviceSubmission(torch.ones(1))
    before = len(fake.calls)
    assert cpu.run(lambda: 7) == 7 and len(fake.calls) == before  # CPU tensors: nothing CUDA


def test_bound_uses_the_handing_thread_stream(monkeypatch):
    fake = _FakeCuda(monkeypatch, current=0)
    fn = streams.bound(lambda a: fake.calls.append(("plug", a)), torch.device("cuda", 3))
    fn("x")
    assert [c for c in fake.calls if c[0] in ("set_device", "stream enter", "plug")] == [
        ("set_device", 3), ("stream enter", "caller"), ("plug", "x")]
    assert streams.bound(len, None) is len


def _fresh_comm_state(monkeypatch, **fields):
    """memrt.comm's process state as before set-up, with ``fields`` set; restored after the test."""
    import dataclasses

    from memrt.comm.setup import STATE, CommState

    fresh = CommState(**fields)
    for f in dataclasses.fields(CommState):
        monkeypatch.setattr(STATE, f.name, getattr(fresh, f.name))


def test_nccl_discovery_waits_for_the_first_collective(monkeypatch):
    """init_process_group on NCCL returns before discovery; the script's set_device comes next; the first
    memrt collective (here get_topology / prepare) discovers on the device then current."""
    import memrt.comm.api as api
    from memrt.comm import setup

    fake = _FakeCuda(monkeypatch, current=0)
    order: list = []
    monkeypatch.setattr(setup.tdist, "init_process_group", lambda **kw: order.append("init"))
    monkeypatch.setattr(setup.tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(setup, "check_settings_agree", lambda config=None: config)
    monkeypatch.setattr(streams, "is_nccl", lambda group=None: True)

    @contextlib.contextmanager
    def on_device(d):
        saved = fake.current
        fake.current = d.index if d is not None else saved
        yield
        fake.current = saved

    monkeypatch.setattr(streams, "on_device", on_device)

    def fake_setup(**kw):
        order.append(("discover", fake.current, kw.get("device")))
        setup.STATE.topology = "topology"
        return setup.STATE.topology

    monkeypatch.setattr(setup, "_setup_topology", fake_setup)
    _fresh_comm_state(monkeypatch)
    api.init_process_group("nccl", init_method="tcp://127.0.0.1:1", world_size=2, rank=1)
    assert order == ["init"] and setup.STATE.deferred is not None  # nothing collective yet
    torch.cuda.set_device(1)  # the script's usual next line
    order.append("set_device")
    assert api.prepare() == "topology"
    assert order == ["init", "set_device", ("discover", 1, torch.device("cuda", 1))]


def _warm_worker(rank: int, world: int):
    import memrt.comm as dist

    dist.get_topology()  # set-up on torch's own gloo group: discovery, groups, warm-up
    from memrt.comm.setup import STATE

    return [list(g) for g in STATE.warmed]


@pytest.mark.slow
def test_groups_are_warmed_once_in_a_fixed_order():
    from memrt.testing import run_processes

    res = run_processes(_warm_worker, 4, env={"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier"}, timeout=120)
    # creation order: node 0's two groups, node 1's two, then the inter-node group of each local slot
    assert res == [[[0, 1], [0, 1], [0, 2]], [[0, 1], [0, 1], [1, 3]],
                   [[2, 3], [2, 3], [0, 2]], [[2, 3], [2, 3], [1, 3]]]


def test_probe_measures_on_the_group_device(monkeypatch, tmp_path):
    """Every measurement of the probe receives group_device(group); on gloo that is the CPU."""
    import torch.distributed as dist

    from memrt.comm import probe

    seen = []
    real = probe._local_rates
    monkeypatch.setattr(probe, "_local_rates", lambda device=None, **kw: (seen.append(device), real(1 << 16, device))[1])
    monkeypatch.setattr(streams, "group_device", lambda group=None: (seen.append("asked"), torch.device("cpu"))[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", world_size=1, rank=0)
    try:
        model = probe.probe_links(((0,),), key="t")
    finally:
        dist.destroy_process_group()
    assert seen == ["asked", torch.device("cpu")] and model.gamma_s_per_byte >= 0


def test_balance_hook_counts_the_staging_wait_as_compute(monkeypatch):
    """On a staged CUDA rank the copy to host first waits for the queued backward: that is compute time."""
    from memrt.balance.hook import WeightedHookState, weighted_allreduce_hook

    class Stream:
        def synchronize(self) -> None:
            time.sleep(0.2)  # the backward queued so far finishes

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    buf = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), mul_=lambda w: None)
    mixed = SimpleNamespace(staging=True, all_reduce_future=lambda b: "future")
    state = WeightedHookState(weight=1.0, world_size=2, mixed=mixed)
    state.start_step(1.0, time.perf_counter())
    state.note_forward()
    assert weighted_allreduce_hook(state, SimpleNamespace(buffer=lambda: buf)) == "future"
    assert state.compute_s >= 0.19 and state.blocked_s < 0.1


def test_offload_held_bytes_running_total_matches_a_scan(tmp_path):
    """The engine's O(1) held-bytes total equals a scan of its live entries after every pack and unpack."""
    from memrt.memory.offload import OffloadEngine
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=3, d_model=64, seq_len=64, n_head=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = gpt_batch(cfg, 4)

    def scan(e) -> int:
        return sum(en.nbytes for en in list(e._live)
                   if (en.src is not None and e.device.type == "cpu") or en.data is not None or en.loading)

    mismatches, checks, peaks = [], [0], [0]
    with OffloadEngine("disk", directory=tmp_path, keep=model, min_bytes=1024, record=False) as eng:
        pack, unpack = eng._pack, eng._unpack

        def checked(fn):
            def run(*a):
                out = fn(*a)
                eng.synchronize()
                with eng._lock:
                    checks[0] += 1
                    s = scan(eng)
                    peaks[0] = max(peaks[0], s)
                    if s != eng.stats().device_held_bytes:
                        mismatches.append((s, eng.stats().device_held_bytes))
                return out
            return run

        eng._pack, eng._unpack = checked(pack), checked(unpack)
        for _ in range(2):
            h = model.tok(x) + model.pos(torch.arange(x.size(1)))
            for i, b in enumerate(model.blocks):
                with eng.pack_hooks(i):
                    h = b(h)
            lm_loss(model.head(model.ln_f(h)), y).backward()
        eng.synchronize()
        assert checks[0] > 20 and not mismatches, mismatches[:5]
        assert eng.stats().device_held_peak_bytes >= peaks[0] > 0
        assert eng.stats().device_held_bytes == scan(eng)


class _StreamLog:
    """Fake CUDA streams and events for the host tier on CPU tensors: every stream call, in order."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[tuple] = []
        log = self.log
        counter = [0]

        class Event:
            def __init__(self, *a, **k) -> None:
                counter[0] += 1
                self.name = f"e{counter[0]}"

            def record(self, stream) -> None:
                log.append(("record", stream.name, self.name))

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                log.append(("host_sync", self.name))

        class Stream:
            def __init__(self, device=None, name: str | None = None) -> None:
                counter[0] += 1
                self.name = name or f"side{counter[0]}"

            def wait_stream(self, other) -> None:
                log.append(("wait_stream", self.name, other.name))

            def wait_event(self, ev) -> None:
                log.append(("wait_event", self.name, ev.name))

            def synchronize(self) -> None:
                log.append(("stream_sync", self.name))

            def __eq__(self, other) -> bool:
                return isinstance(other, Stream) and other.name == self.name

            __hash__ = object.__hash__

        self.compute = Stream(name="compute")

        @contextlib.contextmanager
        def stream_ctx(s):
            log.append(("enter", s.name))
            yield
            log.append(("exit", s.name))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)


def test_host_tier_stream_order_on_cpu(monkeypatch, tmp_path):
    """The host tier's logic with fake streams: gradients equal; copies wait for the compute stream; each
    unit's sources are dropped only after the compute stream waited on their copies; loads wait for their
    store, and the compute stream waits on each load before use; two copy streams; no host sync; the pool
    sized from the plan never grows."""
    import copy

    from memrt.memory.offload import OffloadEngine
    from memrt.memory.offload import host as host_mod
    from memrt.testing.models import GPT, GPTConfig, gpt_batch, lm_loss

    cfg = GPTConfig(n_layer=3, d_model=64, seq_len=64, n_head=2, dropout=0.1)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    x, y = gpt_batch(cfg, 4)

    def step(m, eng=None):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        h = m.drop(m.tok(x) + m.pos(torch.arange(x.size(1))))
        for i, b in enumerate(m.blocks):
            with (eng.pack_hooks(i) if eng is not None else contextlib.nullcontext()):
                h = b(h)
        lm_loss(m.head(m.ln_f(h)), y).backward()
        return [p.grad.clone() for p in m.parameters()]

    want = step(ref)
    fake = _StreamLog(monkeypatch)
    monkeypatch.setattr(host_mod.HostPool, "__init__",
                        lambda self, capacity_bytes, pin=True, _orig=host_mod.HostPool.__init__: _orig(
                            self, capacity_bytes, pin=False))  # no pinned memory without CUDA
    eng = OffloadEngine("disk", device="cpu", directory=tmp_path, keep=model, min_bytes=1024, record=False)
    eng._finalizer()  # the disk tier goes; the host tier's logic runs on CPU tensors with fake streams
    tier = host_mod.HostTier(torch.device("cuda", 0), pool_bytes=host_mod.pool_bytes_for(8 << 20))
    tier.device = torch.device("cpu")
    eng._tier, eng.tier_name, eng._closed = tier, "host", False
    batches = []
    new_file = tier.new_file
    tier.new_file = lambda unit: (batches.append(new_file(unit)), batches[-1])[1]
    for _ in range(2):
        got = step(model, eng)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert batches and not any(b.sources for b in batches)  # every unit's sources let go by backward's end
        for b in batches:  # ... each only after the compute stream waited on its last copy
            assert ("wait_event", "compute", b.event.name) in fake.log
        batches.clear()
    log = fake.log
    d2h, h2d = tier.d2h.name, tier.h2d.name
    assert d2h != h2d  # one stream per direction
    assert not [c for c in log if c[0] in ("host_sync", "stream_sync")]  # nothing blocks the host
    stores = [i for i, c in enumerate(log) if c == ("enter", d2h)]
    loads = [i for i, c in enumerate(log) if c == ("enter", h2d)]
    assert stores and loads
    for i in stores:  # every copy to host waits for the compute stream first
        assert ("wait_stream", d2h, "compute") in log[max(0, i - 3):i]
    store_events = [log[i + 1][2] for i in stores if log[i + 1][0] == "record"]
    for i in loads:  # a load waits for compute (its block's earlier users) and for the store that wrote it
        before = log[max(0, i - 3):i]
        assert ("wait_stream", h2d, "compute") in before
        assert any(c[0] == "wait_event" and c[1] == h2d and c[2] in store_events for c in before)
        done = log[i + 1]
        assert done[0] == "record" and done[1] == h2d
        assert ("wait_event", "compute", done[2]) in log[i + 2:]  # used only after the copy
    assert tier.pool.allocations == 1 and eng.stats().bytes_restored > 0
    eng.close()


def test_flat_cuda_call_is_timed_to_completion(monkeypatch):
    """A flat torch collective on a CUDA tensor: its record's seconds come from CUDA events around the call
    (read later, no host wait) and the hang watchdog tracks the end event, not the enqueue."""
    from memrt.comm import dispatch
    from memrt.comm.topology import Topology
    from memrt.profiling.recorder import Recorder

    fake = _StreamLog(monkeypatch)
    events = []

    class Event:
        def __init__(self, enable_timing=False) -> None:
            self.t = None
            events.append(self)

        def record(self, stream) -> None:
            self.t = len(events)
            fake.log.append(("record", stream.name))

        def query(self) -> bool:
            return False  # the GPU work is still running

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return 250.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    rec = Recorder()
    monkeypatch.setattr("memrt.profiling.recorder.get_recorder", lambda: rec)
    tracked = []
    health = SimpleNamespace(inside=lambda name: contextlib.nullcontext(), track=lambda n, e: tracked.append((n, e)))
    _fresh_comm_state(monkeypatch, topology=Topology.from_nodes(((0, 1),), 0), health=health)
    t = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.float32, element_size=lambda: 4)
    called = []
    dispatch.run_flat("all_reduce", t, 4096, lambda: called.append(fake.log[-1]), async_op=False)
    assert called == [("record", "compute")]  # the start event is on the caller's stream, before the call
    assert len(events) == 2 and tracked == [("all_reduce", events[1])]
    assert rec.comm[0].seconds == 0.0  # not read at enqueue
    assert rec.resolve_pending(block=True) == 0 and rec.comm[0].seconds == pytest.approx(0.25)


def test_ddp_hook_registration_sets_up_groups_first(monkeypatch):
    """register_ddp_hook (also what MEMRT=1 uses) sets memrt.comm up on the model's device before the hook
    exists, so the hook's first call, mid-backward, creates no communicator."""
    import memrt.comm.api as api
    from memrt.comm import ddp_hook

    order = []
    monkeypatch.setattr(api, "prepare", lambda device=None, config=None: order.append(("prepare", device)))
    param = torch.nn.Parameter(torch.ones(2))
    ddp = SimpleNamespace(process_group=None, parameters=lambda: iter([param]),
                          register_comm_hook=lambda state, hook: order.append(("register", hook.__name__)))
    assert ddp_hook.register_ddp_hook(ddp) is ddp
    assert order == [("prepare", param.device), ("register", "ddp_comm_hook")]
