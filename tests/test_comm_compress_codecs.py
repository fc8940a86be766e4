"""Codecs of the slow-tier compression and error feedback, without processes (multi-rank paths: test_comm_fusion_e2e)."""

import pytest
import torch

from memrt.comm.compress import INT8_CHUNK_ELEMENTS, Codec, ErrorFeedback, decode, encode


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("n", [1, 7, INT8_CHUNK_ELEMENTS, 3 * INT8_CHUNK_ELEMENTS + 5])
def test_round_trip_error_bounded_and_wire_size(codec, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    payload = encode(x, codec)
    assert payload.dtype == torch.uint8 and payload.numel() == Codec(codec).wire_bytes(n)
    y = decode(payload, codec, n)
    assert y.shape == x.shape and y.dtype == torch.float32
    rel = {"bf16": 2**-8, "fp16": 2**-11, "int8": None}[codec]
    if rel is not None:
        assert torch.all((y - x).abs() <= x.abs() * rel + 1e-30)
    else:  # int8: error at most half a quantization step of the chunk's scale
        for c in range(0, n, INT8_CHUNK_ELEMENTS):
            xs, ys = x[c:c + INT8_CHUNK_ELEMENTS], y[c:c + INT8_CHUNK_ELEMENTS]
            step = xs.abs().max() / 127
            assert (ys - xs).abs().max() <= step / 2 + 1e-6


def test_int8_zero_chunk_and_wire_bytes_quarter():
    x = torch.zeros(5000)
    assert torch.equal(decode(encode(x, "int8"), "int8", 5000), x)
    assert Codec("int8").wire_bytes(1 << 20) / (4 << 20) < 0.26


def test_unknown_codec_names_setting():
    with pytest.raises(ValueError, match="MEMRT_COMPRESS"):
        Codec("int4")


def test_error_feedback_carries_residual_so_sum_over_steps_is_exact():
    """Compressing the same gradient T times with EF: the sum of what was sent differs from T*g by one residual."""
    ef = ErrorFeedback()
    g = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    sent_total = torch.zeros_like(g)
    no_ef_total = torch.zeros_like(g)
    steps = 20
    for _ in range(steps):
        sent_total += decode(encode(g, "int8", residual=ef.buffer("bucket0", g.numel())), "int8", g.numel())
        no_ef_total += decode(encode(g, "int8"), "int8", g.numel())
    err_ef = (sent_total - steps * g).abs().max().item()
    err_plain = (no_ef_total - steps * g).abs().max().item()
    # with EF the accumulated error stays one residual (< one quantization step); without, it grows with steps
    assert err_ef <= (g.abs().max().item() * 1.1 / 127)
    assert err_plain > 5 * err_ef
    assert torch.allclose(sent_total + ef.residual("bucket0"), steps * g, atol=1e-3)


def test_error_feedback_keys_are_separate_and_size_change_resets():
    ef = ErrorFeedback()
    a, b = torch.randn(4096), torch.randn(100)
    encode(a, "int8", residual=ef.buffer("a", a.numel()))
    encode(b, "int8", residual=ef.buffer("b", b.numel()))
    assert ef.residual("a").abs().sum() > 0 and ef.residual("b").shape == b.shape
    assert ef.buffer("a", 3).equal(torch.zeros(3))  # size changed: a fresh residual, never a wrong-shaped one


def test_blockwise_encode_matches_whole_and_decode_accumulates():
    from memrt.comm.compress import BLOCK_ELEMENTS

    x = torch.randn(2 * BLOCK_ELEMENTS + 77)
    for codec in ("bf16", "int8"):
        y = decode(encode(x, codec), codec, x.numel())
        out = torch.ones(x.numel())
        decode(encode(x, codec), codec, x.numel(), out=out, accumulate=True)
        assert torch.equal(out, y + 1)


# ---------------------------------------------------------------- properties of the codecs (hypothesis)
import math  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

from memrt.comm import codecs  # noqa: E402

F32_MAX = float(torch.finfo(torch.float32).max)
_values = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),  # every float32, denormals and extremes included
    st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1e-38, F32_MAX, -F32_MAX, 65504.0, 65520.0, 3.39e38, 1.0]),
)


@st.composite
def _tensors(draw):
    n = draw(st.one_of(st.sampled_from([0, 1, 2047, 2048, 2049, 4097]), st.integers(0, 5000)))
    pattern = draw(st.sampled_from(["values", "zeros", "const", "normal"]))
    if pattern == "values":
        vals = draw(st.lists(_values, min_size=min(n, 40), max_size=min(n, 40)))
        x = torch.tensor(vals, dtype=torch.float32).repeat(-(-n // max(len(vals), 1)))[:n] if vals else torch.zeros(n)
    elif pattern == "zeros":
        x = torch.zeros(n)
    elif pattern == "const":
        x = torch.full((n,), draw(st.floats(width=32, allow_nan=False, allow_infinity=False)))
    else:
        x = torch.randn(n, generator=torch.Generator().manual_seed(draw(st.integers(0, 1000)))) * draw(
            st.sampled_from([1e-39, 1e-20, 1.0, 1e30]))
    for pos, v in draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), _values), max_size=3)):
        if n:
            x[pos] = v
    return x


def _bound(codec: str, x: torch.Tensor) -> torch.Tensor:
    """The decode error bound stated in memrt.comm.codecs, per element (finite inputs)."""
    a = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).abs()
    if codec == "bf16":
        return 2.0 ** -8 * a + 2.0 ** -134
    if codec == "fp16":
        return 2.0 ** -11 * a + 2.0 ** -25
    full = -(-x.numel() // INT8_CHUNK_ELEMENTS) * INT8_CHUNK_ELEMENTS
    amax = torch.nn.functional.pad(a, (0, full - x.numel())).view(-1, INT8_CHUNK_ELEMENTS).amax(dim=1)
    return (amax.double() / 254 * (1 + 2.0 ** -20) + 2.0 ** -142).repeat_interleave(INT8_CHUNK_ELEMENTS)[:x.numel()]


def _same_specials(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


@settings(max_examples=200, deadline=None)
@given(x=_tensors(), codec=st.sampled_from(["bf16", "fp16", "int8"]), ef=st.booleans())
def test_codec_properties(x, codec, ef):
    """Finite stays finite, specials stay where they are, error within the stated bound, sent == decoded."""
    n = x.numel()
    residual = torch.zeros(n) if ef else None
    sent = torch.empty(n)
    payload = encode(x, codec, residual=residual, sent_out=sent)
    assert payload.numel() == Codec(codec).wire_bytes(n)
    d = decode(payload, codec, n)
    assert _same_specials(d, x)
    fin = torch.isfinite(x)
    assert torch.isfinite(d[fin]).all()
    limit = {"bf16": codecs.BF16_MAX, "fp16": codecs.FP16_MAX, "int8": F32_MAX}[codec]
    inside = fin & (x.abs() <= limit)
    err = (d.double() - x.double()).abs()
    assert (err[inside] <= _bound(codec, x).double()[inside]).all()
    assert torch.equal(d[fin & (x.abs() > limit)].abs(), torch.full_like(d[fin & (x.abs() > limit)], limit))
    assert torch.equal(torch.isnan(sent), torch.isnan(d)) and torch.equal(sent[~torch.isnan(d)], d[~torch.isnan(d)])
    if ef:  # what was not sent is carried, and only finite amounts are
        assert torch.isfinite(residual).all()
        assert torch.equal(residual[fin & torch.isfinite(d)], (x - d)[fin & torch.isfinite(d)])


@settings(max_examples=40, deadline=None)
@given(x=_tensors(), codec=st.sampled_from(["bf16", "fp16", "int8"]), accumulate=st.booleans())
def test_one_pass_path_has_the_same_bits_as_the_blockwise_cpu_path(x, codec, accumulate, monkeypatch_module):
    """Off the CPU the codecs run in one pass with no read-backs: same payload and values as the CPU path."""
    cpu = encode(x, codec)
    monkeypatch_module.setattr(codecs, "_host", lambda t: False)
    try:
        one = encode(x, codec)
        dec_one = decode(one, codec, x.numel(), out=torch.ones(x.numel()), accumulate=accumulate)
    finally:
        monkeypatch_module.undo()
    assert torch.equal(one, cpu)
    dec = decode(cpu, codec, x.numel(), out=torch.ones(x.numel()), accumulate=accumulate)
    assert torch.equal(torch.isnan(dec), torch.isnan(dec_one)) and torch.equal(dec.nan_to_num(), dec_one.nan_to_num())


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_special_values_reach_every_codec_and_int8_flags_only_their_chunk():
    x = torch.randn(3 * INT8_CHUNK_ELEMENTS)
    x[5], x[INT8_CHUNK_ELEMENTS + 7], x[INT8_CHUNK_ELEMENTS + 8] = math.inf, -math.inf, math.nan
    for codec in ("bf16", "fp16", "int8"):
        d = decode(encode(x, codec), codec, x.numel())
        assert _same_specials(d, x)
        assert torch.isfinite(d[2 * INT8_CHUNK_ELEMENTS:]).all()
    scales = encode(x, "int8")[:12].view(torch.float32)
    assert torch.signbit(scales).tolist() == [True, True, False]


def test_auto_compresses_only_where_the_cost_model_predicts_ten_percent():
    from types import SimpleNamespace

    from memrt.comm import costmodel as cm
    from memrt.comm.costmodel import predict
    from memrt.comm.select import choose
    from memrt.config import load_config

    nodes = ((0, 1), (2, 3))

    def topo(inter_bytes_per_s):
        links = cm.LinkModel(intra=cm.TierLink(alpha_s=1e-5, beta_s_per_byte=1 / 10e9),
                             inter=cm.TierLink(alpha_s=1e-4, beta_s_per_byte=1 / inter_bytes_per_s),
                             gamma_s_per_byte=1 / 4e9, codec_s_per_byte={"bf16": 1 / 2e9, "int8": 1 / 1e9})
        return SimpleNamespace(nodes=nodes, links=links)

    n = 64 << 20
    slow, fast = topo(125e6), topo(100e9)
    hier, flat = load_config({"MEMRT_COMM": "hier"}), load_config({"MEMRT_COMM": "flat"})
    c = choose("all_reduce", n, torch.float32, slow, hier, compress="auto")
    assert c.label == "hier+bf16" and ">= 10%" in c.reason and c.predicted_seconds < predict("hier", n, nodes,
                                                                                             slow.links)
    c = choose("all_reduce", n, torch.float32, fast, hier, compress="auto")
    assert c.algorithm == "hier" and "< 10%" in c.reason  # a fast link: encoding costs more than it saves
    c = choose("all_reduce", n, torch.bfloat16, slow, hier, compress="auto")
    assert c.algorithm == "hier"  # bf16 of a bf16 tensor saves no bytes
    c = choose("all_reduce", n, torch.float32, slow, flat, compress="auto")
    assert c.algorithm == "flat" and "MEMRT_COMM=flat" in c.reason
    c = choose("all_reduce", n, torch.float32, fast, load_config({}), compress="int8")
    assert c.label == "hier+int8" and "asked" in c.reason  # a named codec is the caller's choice


def test_compress_values_checked_with_the_setting_named():
    from memrt.comm.ddp_hook import DDPHookState

    with pytest.raises(ValueError, match="compress='int4' is not valid: expected one of none\\|auto"):
        DDPHookState(compress="int4")
    assert DDPHookState(compress="auto").compress == "auto"
