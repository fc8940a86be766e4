"""Property tests (hypothesis) of the compressed all-reduce on 4 real ranks, every codec, both pipelines.

One process group serves every example: rank 0 runs hypothesis (generation and shrinking) and sends each
case to the other ranks, which run the same collectives and send back their results. Pipelines:
``hier`` = the two-node hierarchical pipeline (``MEMRT_TOPOLOGY=0,1;2,3``: exact intra-node hop, the
inter-node shard exchanged compressed between 2 ranks), ``all_to_all`` = the compressed reduce-scatter
(all-to-all) + all-gather that runs across more than two nodes (here the 4 ranks of the world group).

Properties, per case: every rank's result identical (NaN at the same positions, the same bits
elsewhere); +-inf and NaN exactly where torch.distributed's all_reduce has them, finite elsewhere; the
error against torch.distributed within the codec's stated bound (memrt.comm.codecs) summed over what
each stage encodes; with error feedback, the second reduction of the same buffer within twice that.
"""

import math

import pytest
import torch

WORLD = 4
ENV = {"MEMRT_TOPOLOGY": "0,1;2,3", "MEMRT_COMM": "hier"}
EXAMPLES = 60
F32_MAX = float(torch.finfo(torch.float32).max)


def make_tensor(case: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input for ``case`` (deterministic)."""
    n, kind = case["n"], case["kind"]
    g = torch.Generator().manual_seed(case["seed"] * 7 + rank)
    base = torch.randn(n, generator=g)
    if kind == "zeros":
        x = torch.zeros(n)
    elif kind == "const":
        x = torch.full((n,), case["const"])
    elif kind == "denormal":
        x = base * 1e-39
    elif kind == "tiny":
        x = base * 1e-30
    elif kind == "nearmax":  # four of them still sum to a finite value, as in stock
        x = base.sign() * F32_MAX * 0.2 * torch.rand(n, generator=g).mul(0.1).add(0.9)
    elif kind == "mixed":  # signs and magnitudes from 1e-38 to 1e30 side by side
        x = base * torch.pow(10.0, torch.randint(-38, 31, (n,), generator=g).float())
    else:
        x = base * case["const"]
    for c in case["zero_chunks"]:
        x[c * 2048:(c + 1) * 2048] = 0.0
    for r, frac, v in case["specials"]:
        if r == rank and n:
            x[min(n - 1, int(frac * n))] = v
    return x


def _bound(case: dict, xs: list[torch.Tensor]) -> torch.Tensor:
    """Largest admissible |memrt - stock| per element (see module docstring and memrt.comm.codecs)."""
    finite = [torch.where(torch.isfinite(x), x, torch.zeros_like(x)) for x in xs]
    a = sum(f.abs() for f in finite)  # per element, sum over ranks of |x|
    rounding = a * 2.0 ** -21 + 1e-44  # float32 sums in another order than gloo's
    codec = case["codec"]
    if codec == "int8":
        m = sum(f.abs().max() if f.numel() else torch.tensor(0.0) for f in finite)
        stages = 1.001 if case["path"] == "hier" else 2.01
        b = torch.full_like(a, float(m) * stages / 254 * (1 + 2 ** -20) + 4 * 2.0 ** -142)
    else:
        eps, tiny = (2.0 ** -8, 2.0 ** -134) if codec == "bf16" else (2.0 ** -11, 2.0 ** -25)
        b = 2 * eps * (1 + eps) * a + 8 * tiny
    return (b * (2 if case["ef"] else 1)) + rounding


def check(case: dict, results: list, inputs: list[torch.Tensor], stock: torch.Tensor) -> list[str]:
    """Everything the properties say about one case; returns the failures."""
    fails = []
    first = results[0]
    for r, res in enumerate(results):
        if not (torch.equal(torch.isnan(res), torch.isnan(first))
                and torch.equal(res[~torch.isnan(res)], first[~torch.isnan(first)])):
            fails.append(f"rank {r} result differs from rank 0's")
    for name, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(fn(first), fn(stock)):
            fails.append(f"{name} positions differ from torch.distributed: {fn(first).nonzero()[:5].tolist()} vs "
                         f"{fn(stock).nonzero()[:5].tolist()}")
    ok = torch.isfinite(stock) & torch.isfinite(first)
    limit = _bound(case, inputs)
    if case["codec"] == "fp16":  # beyond fp16's range values saturate: only finiteness is promised there
        ok &= sum(x.abs() for x in inputs) <= 65504 / 2
    err = (first - stock).abs()
    bad = ok & (err > limit)
    if bad.any():
        i = int(bad.nonzero()[0])
        fails.append(f"error {err[i].item():.3g} > bound {limit[i].item():.3g} at {i} (stock {stock[i].item():.6g}, "
                     f"memrt {first[i].item():.6g})")
    return fails


def run_case(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's result of the compressed all-reduce of ``case`` (the second call's with feedback),
    torch.distributed.all_reduce's result)."""
    import torch.distributed as tdist

    from memrt.comm import api
    from memrt.comm.compress import FeedbackKey, compressed_all_reduce

    key = FeedbackKey(owner=("property", case["id"])) if case["ef"] else None
    y = make_tensor(case, rank)
    for _ in range(2 if case["ef"] else 1):
        y = make_tensor(case, rank)
        if case["path"] == "hier":
            api.all_reduce_with(y, tdist.ReduceOp.SUM, None, False, key=key, codec=case["codec"])
        else:
            compressed_all_reduce(y, None, case["codec"], key)
    stock = make_tensor(case, rank)
    tdist.all_reduce(stock)
    return y, stock


def _driver(rank, world):
    import torch.distributed as tdist

    import memrt.comm as dist

    dist.setup_topology(health=False)
    if rank != 0:
        while True:
            box = [None]
            tdist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return "ok"
            try:
                res = run_case(box[0], rank)
            except Exception as exc:  # noqa: BLE001 - sent to rank 0, which fails the example
                res = f"{type(exc).__name__}: {exc}"
            tdist.gather_object(res, None, dst=0)
    from hypothesis import HealthCheck, given, settings, strategies as st

    counter = [0]
    lengths = st.one_of(st.sampled_from([0, 1, 2, 7, 2047, 2048, 2049, 4097, 6145, 262_145]),
                        st.integers(min_value=0, max_value=20_000))
    special = st.tuples(st.integers(0, world - 1), st.floats(0, 1),
                        st.sampled_from([math.inf, -math.inf, math.nan]))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(codec=st.sampled_from(["bf16", "fp16", "int8"]), ef=st.booleans(), path=st.sampled_from(["hier", "all_to_all"]),
           n=lengths, kind=st.sampled_from(["normal", "zeros", "const", "denormal", "tiny", "nearmax", "mixed"]),
           const=st.sampled_from([1.0, -3.5, 1e-20, 6e4, 1e30]), seed=st.integers(0, 2 ** 16),
           zero_chunks=st.lists(st.integers(0, 4), max_size=2), specials=st.lists(special, max_size=3))
    def prop(**case):
        counter[0] += 1
        case["id"] = counter[0]
        box = [case]
        tdist.broadcast_object_list(box, src=0)
        try:
            mine = run_case(case, 0)
        except Exception as exc:  # noqa: BLE001
            mine = f"{type(exc).__name__}: {exc}"
        results = [None] * world
        tdist.gather_object(mine, results, dst=0)
        errors = [r for r in results if isinstance(r, str)]
        assert not errors, f"{case}: {errors}"
        fails = check(case, [r[0] for r in results], [make_tensor(case, r) for r in range(world)], results[0][1])
        assert not fails, f"{case}: {fails}"

    try:
        prop()
        return f"ok: {counter[0]} examples"
    except Exception as exc:  # noqa: BLE001 - reported by the parent with the falsifying case
        return f"FAILED: {exc}"
    finally:
        tdist.broadcast_object_list([None], src=0)


@pytest.mark.slow
def test_compressed_all_reduce_properties_on_four_ranks(tmp_path):
    pytest.importorskip("hypothesis")
    from memrt.testing import run_processes

    res = run_processes(_driver, WORLD, env={**ENV, "MEMRT_REPORT_DIR": str(tmp_path)}, timeout=280)
    assert res[0].startswith("ok"), res[0]
