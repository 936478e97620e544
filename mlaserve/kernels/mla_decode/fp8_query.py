"""The absorbed query as two fp8 (e4m3) terms per head, for decode dots on fp8 tensor cores (gluon_fp8.py).

q ≈ hi·a + lo·b over a head's latent and rope parts together: a = max|q| / 448 and hi is q / a rounded to e4m3;
lo is the residual q - hi·a, scaled by its own b = max|residual| / 448. Two e4m3 terms keep about 8 significant bits,
bf16's precision. Split once per decode step, here, rather than in every split-KV program that reads the same heads.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def round_e4m3(x):
    """x (|x| <= 448) rounded to an e4m3 value in fp32 arithmetic: a step of 2^-3 times x's leading power of two,
    2^-9 below 2^-6 (e4m3's subnormals), halves rounded up. Converting the result to e4m3 is then exact, and a
    residual can be taken against it without converting back. (gluon_fp8._round_e4m3 is the same in Gluon.)"""
    lead = tl.maximum(
        x.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23
    )  # biased exponent, at least 2^-6's
    step = (lead - (3 << 23)).to(tl.float32, bitcast=True)
    inv_step = ((254 << 23) - lead + (3 << 23)).to(tl.float32, bitcast=True)  # powers of two: exact products
    return tl.floor(x * inv_step + 0.5) * step


@triton.jit
def _split_queries(
    Q, QPe, Terms, Scales, stride_qb, stride_qh, stride_pb, stride_ph, heads,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):  # fmt: skip
    # the grid launched after this one with launch_pdl may start now (see split_queries)
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < heads
    lat = tl.arange(0, D_LAT)
    rope = tl.arange(0, D_ROPE)
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + lat[None, :], mask=ok[:, None], other=0.0)
    q_pe = tl.load(QPe + b * stride_pb + h[:, None] * stride_ph + rope[None, :], mask=ok[:, None], other=0.0)
    q, q_pe = q.to(tl.float32), q_pe.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q), 1), tl.max(tl.abs(q_pe), 1))
    a = tl.where(amax > 0, amax / 448.0, 1.0)[:, None]
    hi = round_e4m3(q / a)
    hi_pe = round_e4m3(q_pe / a)
    r = q - hi * a
    r_pe = q_pe - hi_pe * a
    rmax = tl.maximum(tl.max(tl.abs(r), 1), tl.max(tl.abs(r_pe), 1))
    lo_scale = tl.where(rmax > 0, rmax / 448.0, 1.0)[:, None]
    row = (b * heads + h).to(tl.int64) * 2
    out = Terms + row[:, None] * (D_LAT + D_ROPE)
    tl.store(out + lat[None, :], hi.to(tl.float8e4nv), mask=ok[:, None])
    tl.store(out + D_LAT + rope[None, :], hi_pe.to(tl.float8e4nv), mask=ok[:, None])
    # lo is rounded here too: the interpreter's fp32 -> e4m3 conversion drops the carry of a value just under a power
    # of two (7.97 -> 4.0, Triton 3.6); converting exact e4m3 values needs no rounding
    lo = round_e4m3(r / lo_scale).to(tl.float8e4nv)
    tl.store(out + D_LAT + D_ROPE + lat[None, :], lo, mask=ok[:, None])
    tl.store(
        out + 2 * D_LAT + D_ROPE + rope[None, :],
        round_e4m3(r_pe / lo_scale).to(tl.float8e4nv),
        mask=ok[:, None],
    )
    tl.store(Scales + row, tl.reshape(a, [BLOCK_H]), mask=ok)
    tl.store(Scales + row + 1, tl.reshape(lo_scale, [BLOCK_H]), mask=ok)


def split_queries(
    q: torch.Tensor, q_pe: torch.Tensor, launch_dependents: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, d_lat], q_pe [B, H, d_rope] (last dimension contiguous, widths powers of two) -> terms [B, H, 2,
    d_lat + d_rope] e4m3 (hi, then lo; each row latent then rope) and scales [B, H, 2] float32 (a, b).

    launch_dependents (compiled kernels on Hopper or later, not the interpreter): every program lets the next grid
    start at once, so a split step launched with programmatic dependent launch sets up beside this kernel and waits
    for its results (griddepcontrol.wait) only where it reads them."""
    batch, heads, d_lat = q.shape
    d_rope = q_pe.shape[-1]
    terms = torch.empty(batch, heads, 2, d_lat + d_rope, dtype=torch.float8_e4m3fn, device=q.device)
    scales = torch.empty(batch, heads, 2, dtype=torch.float32, device=q.device)
    # 4 heads per program: one head per program looked a little slower, 16 heads per program slower still
    block_h = 4
    _split_queries[(batch, triton.cdiv(heads, block_h))](
        q, q_pe, terms, scales, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), heads,
        D_LAT=d_lat, D_ROPE=d_rope, BLOCK_H=block_h, LAUNCH_DEPENDENTS=launch_dependents,
    )  # fmt: skip
    return terms, scales
