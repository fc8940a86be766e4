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
