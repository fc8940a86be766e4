"""Codecs of the slow-hop compression: float tensor <-> uint8 payload, safe on real gradients.

Every codec keeps the IEEE special values and never makes a finite input non-finite:

- ``bf16`` / ``fp16``: a cast. Finite values beyond the format's largest finite value saturate to it
  (a plain cast would round them to inf); +-inf and NaN stay +-inf and NaN.
- ``int8``: one float32 scale per :data:`INT8_CHUNK_ELEMENTS` elements, ``scale = amax / 127`` over the
  chunk, codes ``round(x / scale)`` in [-127, 127]. A chunk holding +-inf or NaN stores its scale with
  the sign bit set and its finite values in [-126, 126]; code 127 is +inf, -127 is -inf, -128 is NaN.
  An all-zero chunk decodes to exact zeros.

Decode error bounds (``x`` the input value, ``amax`` the largest finite ``|x|`` of its int8 chunk); the
tests check these:

- bf16: ``|d - x| <= 2**-8 |x| + 2**-134`` for ``|x| <= BF16_MAX``; larger finite values decode to
  ``+-BF16_MAX``.
- fp16: ``|d - x| <= 2**-11 |x| + 2**-25`` for ``|x| <= 65504``; larger finite values decode to ``+-65504``.
- int8: ``|d - x| <= amax / 254 * (1 + 2**-20) + 2**-142`` (half a quantization step; the last term only
  matters when ``amax / 127`` is a float32 subnormal).
- Non-finite inputs decode to the same value (NaN to a NaN), in every codec.

Encoding works in blocks of :data:`BLOCK_ELEMENTS` on CPU (temporaries stay in cache; the block
boundaries are chunk boundaries, so the bits do not depend on them) and in one pass on other devices,
where each operation is a kernel launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CODECS", "Codec", "INT8_CHUNK_ELEMENTS", "BLOCK_ELEMENTS", "BF16_MAX", "FP16_MAX", "encode", "decode",
           "check_codec"]

CODECS = ("bf16", "fp16", "int8")
INT8_CHUNK_ELEMENTS = 2048
"""Elements sharing one float32 scale in the int8 codec (overhead 4 bytes per 2048 bytes = 0.2%)."""
BLOCK_ELEMENTS = 64 * INT8_CHUNK_ELEMENTS
"""Elements per pass on CPU: blocks stay in cache and temporaries are reused (large tensors at once fall
out of cache and page-fault fresh allocations, several times slower)."""
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_SMALL_AMAX = 127 * _F32_TINY
"""Below this (and above 0) a chunk's scale would be a float32 subnormal: quantized by division."""
_BIG_AMAX = 2.0 ** 127
"""Above this, 127 * fl(amax / 127) may round past float32's largest value: the scale is rounded down."""
_POS_INF, _NEG_INF, _NAN = 127, -127, -128
"""int8 codes of the special values in a chunk flagged by its scale's sign bit."""


@dataclass(frozen=True, slots=True)
class Codec:
    """A codec's name and its wire size: ``wire_bytes(numel)`` bytes for ``numel`` elements."""

    name: str

    def __post_init__(self) -> None:
        check_codec(self.name)

    def wire_bytes(self, numel: int) -> int:
        if self.name == "int8":
            return 4 * _chunks(numel) + numel
        return 2 * numel


def check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r} is not valid: expected one of {'|'.join(CODECS)} (MEMRT_COMPRESS or compress=)")


def _chunks(numel: int) -> int:
    return -(-numel // INT8_CHUNK_ELEMENTS)


def _host(t: torch.Tensor) -> bool:
    """True when checks that read a value back (a sync elsewhere) are cheap: CPU tensors. Elsewhere the
    codecs take the path that handles every special case with no read-back, one launch per operation."""
    return t.device.type == "cpu"


def _block(numel: int, t: torch.Tensor) -> int:
    return BLOCK_ELEMENTS if _host(t) else max(numel, 1)


# ---------------------------------------------------------------- casts
def _cast_into(y: torch.Tensor, dst: torch.Tensor, limit: float, x: torch.Tensor | None) -> bool:
    """``dst`` (bf16/fp16) = ``y`` with finite values beyond ``limit`` saturated, inf and NaN kept.

    ``x`` (with error feedback: ``y = x + residual``): where ``x`` is finite but ``y`` is not, ``x`` is
    sent. Returns whether the slow path ran (the block had non-finite or out-of-range values).
    """
    dst.copy_(y)
    if _host(y) and math.isfinite(dst.sum().item()):  # the common case: one cheap check
        return False
    if x is not None:
        y = _keep_finite_input(y, x)
    dst.copy_(torch.where(torch.isinf(y), y, y.clamp(-limit, limit)))
    return True


def _keep_finite_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (x + residual) with ``x`` put back where x is finite and the sum is not."""
    n = x.numel()
    head = y[:n]
    bad = ~torch.isfinite(head) & torch.isfinite(x)
    y = y.clone()
    y[:n] = torch.where(bad, x.float(), head)
    return y


# ---------------------------------------------------------------- int8
def _chunk_amax(v: torch.Tensor) -> torch.Tensor:
    """max |v| per chunk row (NaN / inf for rows holding them)."""
    # amax and amin separately: torch.aminmax(dim=1) is ~10x slower on CPU (torch 2.13)
    return torch.maximum(v.amax(dim=1), v.amin(dim=1).neg_())


def _quantize(v: torch.Tensor, amax: torch.Tensor, scale_out: torch.Tensor, q_out: torch.Tensor,
              any_odd: bool) -> torch.Tensor:
    """Chunks ``v`` (nc, C) float32 with their ``amax`` -> scales (nc,) float32 and codes (nc * C,) int8.

    ``any_odd``: some chunk may hold inf/NaN or have a subnormal scale (then those chunks take the
    exact path). Returns the codes as floats (nc, C).
    """
    scale = amax.div(127.0)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)).unsqueeze(1)
    q = (v * inv).round_()  # |v * inv| <= 127 (1 + 2**-22) for a normal scale: no clamp needed
    if any_odd:
        rows = (~torch.isfinite(amax) | ((amax > 0) & (amax < _SMALL_AMAX)) | (amax > _BIG_AMAX)).nonzero().squeeze(1)
        if rows.numel():
            sub_scale, sub_q = _quantize_odd(v.index_select(0, rows))
            scale.index_copy_(0, rows, sub_scale)
            q.index_copy_(0, rows, sub_q)
    scale_out.copy_(scale)
    q_out.copy_(q.view(-1)[: q_out.numel()])
    return q


def _quantize_odd(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks with +-inf/NaN (flagged scale, finite codes in [-126, 126]), a subnormal scale, or values so
    large that the scale is rounded down (then ``|q| * scale <= amax`` cannot overflow)."""
    finite = torch.isfinite(v)
    special = (~finite).any(dim=1)
    vf = torch.where(finite, v, torch.zeros_like(v))
    amax = vf.abs().amax(dim=1)
    levels = torch.where(special, 126.0, 127.0)
    scale = amax / levels
    scale = torch.where(amax > _BIG_AMAX, torch.nextafter(scale, torch.zeros_like(scale)), scale).unsqueeze(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, vf / safe, torch.zeros_like(vf)).round_()  # division: a subnormal scale's
    q = torch.minimum(torch.maximum(q, -levels.unsqueeze(1)), levels.unsqueeze(1))  # reciprocal overflows
    q = torch.where(v == torch.inf, float(_POS_INF), q)
    q = torch.where(v == -torch.inf, float(_NEG_INF), q)
    q = torch.where(torch.isnan(v), float(_NAN), q)
    scale = scale.squeeze(1)
    return torch.where(special, -scale, scale), q  # sign bit set (also on 0.0) flags a special chunk


def _dequantize(q: torch.Tensor, scale: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool) -> None:
    """``out`` (=, or += with ``accumulate``) the values of ``n`` codes ``q`` (int8) with chunk ``scale``."""
    nc = scale.numel()
    full = nc * INT8_CHUNK_ELEMENTS
    blk = q.float()
    if full != n:
        blk = torch.nn.functional.pad(blk, (0, full - n))
    flagged = torch.signbit(scale)
    vals = blk.view(nc, INT8_CHUNK_ELEMENTS).mul_(scale.abs().unsqueeze(1))
    if not _host(q) or any(math.copysign(1.0, c) < 0 for c in scale.tolist()):
        rows = flagged.nonzero().squeeze(1)
        if rows.numel():
            sq = _codes_of(q, rows, n)  # from q: vals was computed in place of the float codes
            fixed = vals.index_select(0, rows)
            fixed = torch.where(sq == _POS_INF, torch.inf, fixed)
            fixed = torch.where(sq == _NEG_INF, -torch.inf, fixed)
            fixed = torch.where(sq == _NAN, torch.nan, fixed)
            vals.index_copy_(0, rows, fixed)
    flat = vals.view(-1)[:n]
    if accumulate:
        out += flat
    else:
        out.copy_(flat)


def _codes_of(q: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 codes of chunk ``rows`` as an (len(rows), C) tensor (the tail padded with 0)."""
    full = _chunks(n) * INT8_CHUNK_ELEMENTS
    padded = q if full == n else torch.nn.functional.pad(q, (0, full - n))
    return padded.view(-1, INT8_CHUNK_ELEMENTS).index_select(0, rows)


# ---------------------------------------------------------------- public
def encode(x: torch.Tensor, codec: str, *, residual: torch.Tensor | None = None,
           sent_out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat float tensor -> uint8 payload of ``Codec(codec).wire_bytes(x.numel())`` bytes.

    With ``residual`` (float32, same numel) error feedback runs in the same pass: ``x + residual`` is
    encoded and ``residual`` becomes (in place) what the payload is missing of it. Where ``x`` is finite
    but ``x + residual`` is not, ``x`` alone is sent; where what is sent is inf or NaN the residual is
    reset to 0 (a non-finite value is sent as such, never carried into the next call). ``sent_out``
    (float32, same numel) receives the decoded payload, bitwise what :func:`decode` returns.
    """
    check_codec(codec)
    x = x.reshape(-1)
    numel = x.numel()
    payload = torch.empty(Codec(codec).wire_bytes(numel), dtype=torch.uint8, device=x.device)
    step = _block(numel, x)
    scratch = (torch.empty(min(numel, step), device=x.device)
               if residual is not None and sent_out is None else None)
    head = 4 * _chunks(numel)
    for s in range(0, numel, step):
        e = min(numel, s + step)
        y = x[s:e].float()
        if residual is not None:
            y = y + residual[s:e]
        sent = sent_out[s:e] if sent_out is not None else (scratch[: e - s] if scratch is not None else None)
        if codec == "int8":
            y, odd = _encode_int8(y, x[s:e] if residual is not None else None, payload, head, s, e, sent)
        else:
            dst = payload[2 * s: 2 * e].view(torch.bfloat16 if codec == "bf16" else torch.float16)
            odd = _cast_into(y, dst, BF16_MAX if codec == "bf16" else FP16_MAX,
                             x[s:e] if residual is not None else None)
            if odd and residual is not None:
                y = _keep_finite_input(y, x[s:e])
            if sent is not None:
                sent.copy_(dst)
        if residual is not None:
            r = residual[s:e]
            torch.sub(y, sent, out=r)
            if odd:  # inf - inf, NaN: nothing to carry
                r.masked_fill_(~torch.isfinite(r), 0.0)
    return payload


def _encode_int8(y: torch.Tensor, x: torch.Tensor | None, payload: torch.Tensor, head: int, s: int, e: int,
                 sent: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Quantize block ``y`` (elements s..e) into ``payload`` (decoded values into ``sent``).

    Returns what was encoded (``y``, or ``x`` where only ``x`` was finite) and whether the block held
    non-finite values.
    """
    n = e - s
    nc = _chunks(n)
    full = nc * INT8_CHUNK_ELEMENTS
    v = y if full == n else torch.nn.functional.pad(y, (0, full - n))
    amax = _chunk_amax(v.view(nc, INT8_CHUNK_ELEMENTS))
    odd = special = True
    if _host(y):  # one small host copy of the chunk maxima decides both questions
        a = amax.tolist()
        odd = not all(math.isfinite(m) for m in a)
        special = odd or any(0.0 < m < _SMALL_AMAX or m > _BIG_AMAX for m in a)
    if odd and x is not None:
        v = _keep_finite_input(v, x)
        amax = _chunk_amax(v.view(nc, INT8_CHUNK_ELEMENTS))
    c0 = s // INT8_CHUNK_ELEMENTS
    scale = payload[4 * c0: 4 * (c0 + nc)].view(torch.float32)
    codes = payload[head + s: head + e].view(torch.int8)
    q = _quantize(v.view(nc, INT8_CHUNK_ELEMENTS), amax, scale, codes, special)
    if sent is not None:
        if special:
            _dequantize(codes, scale, n, sent, False)
        elif full == n:  # the decoded values straight from the float codes: the same products as decode's
            torch.mul(q, scale.unsqueeze(1), out=sent.view(nc, INT8_CHUNK_ELEMENTS))
        else:
            sent.copy_(q.mul_(scale.unsqueeze(1)).view(-1)[:n])
    return v[:n], odd


def decode(payload: torch.Tensor, codec: str, numel: int, *, out: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """uint8 payload -> flat float32 tensor of ``numel`` elements (into ``out``; ``accumulate`` adds to it)."""
    check_codec(codec)
    if payload.storage_offset() % 4:  # a slice of a received buffer: realign before viewing as wider types
        payload = payload.clone()
    if out is None:
        out = torch.empty(numel, device=payload.device)
        accumulate = False
    step = _block(numel, payload)
    if codec in ("bf16", "fp16"):
        src = payload[: 2 * numel].view(torch.bfloat16 if codec == "bf16" else torch.float16)
        for s in range(0, numel, step):
            e = min(numel, s + step)
            if accumulate:
                out[s:e] += src[s:e]
            else:
                out[s:e].copy_(src[s:e])
        return out
    head = 4 * _chunks(numel)
    scale = payload[:head].view(torch.float32)
    q = payload[head: head + numel].view(torch.int8)
    for s in range(0, numel, step):
        e = min(numel, s + step)
        c0 = s // INT8_CHUNK_ELEMENTS
        _dequantize(q[s:e], scale[c0:c0 + _chunks(e - s)], e - s, out[s:e], accumulate)
    return out
