"""MLA's per-step cache write as one Triton kernel, for CUDA: norm the latent, rotate the shared key and every
query head's rope part, store the cache row (8-bit rows quantized on the way).

In eager torch this is the latent's RMSNorm, the rotary kernel, the row concatenation, the 8-bit quantization
(about ten kernels of its own) and the scatter into the cache; in a decode step of a few tokens each is mostly
launch latency, once per layer. Here one program per token does all of it. The queries' rope parts are rotated in
place, so prefill reads q as it is and decode passes the rope part on as a view, with no concatenation.

Numerics are the separate kernels': the norm rounds as norm.py does, the rotation as rotary.py (fp32, one
rounding to the input's dtype), and the row is then cast to the cache dtype or quantized as quant.quantize_rows
does it (scale = max |x| / the format's max, int8 rounded half to even). `MLAAttention.rope_and_cache` in mla.py
is the torch path it is tested against.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kernels.rotary import cos_sin, rotated_halves
from mlaserve.kvcache.quant import TAIL_BYTES, is_quantized, quant_max

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mla_prep_kernel(
    KV, Q, Pos, InvFreq, NormW, Cache, Slots,
    stride_kv, stride_qt, stride_qh, stride_pos, stride_cache,
    num_heads, eps, scaling, qmax,
    D_LAT: tl.constexpr, LAT_P2: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, QUANT: tl.constexpr, INT8: tl.constexpr,
    NORM_DTYPE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)  # int64: t * row stride can pass 2**31 in a long prefill
    cos, sin = cos_sin(Pos, InvFreq, t, stride_pos, scaling, HALF, HALF_P2)
    j = tl.arange(0, HALF_P2)
    j_ok = j < HALF

    # Every query head's rope part, in place. The rotation moves features between threads (interleaved pairs
    # come out de-interleaved), so all loads must land before any store: the barrier.
    q_tok = Q + t * stride_qt + NOPE
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        heads_ok = heads < num_heads
        row = q_tok + heads[:, None] * stride_qh
        o1, o2 = rotated_halves(row, heads_ok, 1, cos, sin, HALF, HALF_P2, BLOCK_H, INTERLEAVED)
        tl.debug_barrier()
        mask = heads_ok[:, None] & j_ok[None, :]
        dtype = Q.dtype.element_ty
        tl.store(row + j[None, :], o1.to(dtype), mask=mask)
        tl.store(row + HALF + j[None, :], o2.to(dtype), mask=mask)

    # The latent's RMSNorm, rounded as the reference: normed row to x's dtype, then the weight multiply.
    kv_tok = KV + t * stride_kv
    c = tl.arange(0, LAT_P2)
    c_ok = c < D_LAT
    x = tl.load(kv_tok + c, mask=c_ok, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / D_LAT + eps)
    normed = (x32 * rstd).to(KV.dtype.element_ty).to(tl.float32)
    w = tl.load(NormW + c, mask=c_ok, other=0.0)
    latent = (normed * w.to(tl.float32)).to(NORM_DTYPE)  # the dtype `weight * x` has in torch
    latent = latent.to(tl.float32)

    # The shared key's rope part: one "head", rounded to the projection's dtype like the rotary kernel's output.
    k_row = (kv_tok + D_LAT + tl.zeros([1], tl.int64))[:, None]
    k1, k2 = rotated_halves(k_row, tl.full([1], 1, tl.int1), 1, cos, sin, HALF, HALF_P2, 1, INTERLEAVED)
    k1 = k1.to(KV.dtype.element_ty).to(tl.float32)
    k2 = k2.to(KV.dtype.element_ty).to(tl.float32)

    dst = Cache + tl.load(Slots + t) * stride_cache
    if QUANT:
        amax = tl.max(tl.abs(latent), 0)
        amax = tl.maximum(
            amax, tl.maximum(tl.max(tl.max(tl.abs(k1), 1), 0), tl.max(tl.max(tl.abs(k2), 1), 0))
        )
        scale = tl.maximum(amax, 1e-8) / qmax
        latent = latent / scale
        k1 = k1 / scale
        k2 = k2 / scale
        if INT8:  # round half to even, as torch.round, then clamp
            latent, k1, k2 = _to_int_grid(latent, qmax), _to_int_grid(k1, qmax), _to_int_grid(k2, qmax)
        else:
            latent, k1, k2 = _to_e4m3_grid(latent), _to_e4m3_grid(k1), _to_e4m3_grid(k2)
        tail = dst + D_LAT + 2 * HALF
        tl.store(tail.to(tl.pointer_type(tl.float32)), scale)
        pad = (tail + 4).to(tl.pointer_type(tl.int32)) + tl.arange(0, 4)
        tl.store(pad, tl.zeros([4], tl.int32), mask=tl.arange(0, 4) < 3)
    out_dtype = Cache.dtype.element_ty
    tl.store(dst + c, latent.to(out_dtype), mask=c_ok)
    k_dst = dst + D_LAT + j[None, :]
    tl.store(k_dst, k1.to(out_dtype), mask=j_ok[None, :])
    tl.store(k_dst + HALF, k2.to(out_dtype), mask=j_ok[None, :])


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _to_int_grid(x, qmax):
    return tl.minimum(tl.maximum(_round_half_even(x), -qmax), qmax)


@triton.jit
def _to_e4m3_grid(x):
    """x rounded to the nearest fp8 e4m3 value (ties to even, saturating at 448), still in fp32.

    The cast that follows is then exact. Rounding here rather than in the cast: Triton's CPU interpreter drops
    the carry when a mantissa rounds up into the next power of two (124 came out as 64), so CI could not check
    the kernel's bytes against quantize_rows; the GPU's own conversion rounds the same way as this."""
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 127 - 6)  # e4m3's subnormals share its smallest normal's spacing, 2**-9
    ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return tl.minimum(tl.maximum(_round_half_even(x / ulp) * ulp, -448.0), 448.0)


def mla_prep(
    positions: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    scaling: float,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """q: [T, H, nope + rope], its rope part rotated in place; kv: [T, kv_lora_rank + rope], the kv_a
    projection's output (latent, then the shared key's rope part); cache: [blocks, page, 1, row] rows of
    kv_lora_rank + rope values (+ the 16-byte scale tail for 8-bit caches); slot_mapping [T]: each token's row."""
    num_tokens, num_heads, q_width = q.shape
    rope = 2 * inv_freq.numel()
    d_lat = kv.shape[1] - rope
    quantized = is_quantized(cache.dtype)
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("mla_prep: q and kv need contiguous last dimensions")
    if cache.shape[-1] != d_lat + rope + (TAIL_BYTES if quantized else 0) or q_width <= rope:
        raise ValueError(
            f"mla_prep: cache rows {cache.shape[-1]}, q width {q_width} for latent {d_lat} + rope {rope}"
        )
    if num_tokens == 0:  # a zero-size grid is not a valid launch
        return
    half = rope // 2
    half_p2 = triton.next_power_of_2(half)
    rows = cache.view(-1, cache.shape[-1])
    block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // half_p2))
    _mla_prep_kernel[(num_tokens,)](
        kv, q, positions, inv_freq.float().contiguous(), norm_weight, rows, slot_mapping,
        kv.stride(0), q.stride(0), q.stride(1), positions.stride(0), rows.stride(0),
        num_heads, eps, float(scaling), quant_max(cache.dtype) if quantized else 1.0,
        D_LAT=d_lat, LAT_P2=triton.next_power_of_2(d_lat), NOPE=q_width - rope, HALF=half, HALF_P2=half_p2,
        BLOCK_H=block_h, INTERLEAVED=interleaved, QUANT=quantized, INT8=cache.dtype == torch.int8,
        NORM_DTYPE=_TL_DTYPES[torch.promote_types(norm_weight.dtype, kv.dtype)],
        num_warps=4, **pdl_launch(q),
    )  # fmt: skip
