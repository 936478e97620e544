"""Per-token-group FP8 activation quantization as a Triton kernel, and the jit helpers the W8A8 GEMM reuses to
quantize its A tiles in place.

The numbers are layers/block_fp8.quantize_per_token_group's: each token's `group` columns share one float32 scale,
their largest magnitude (at least 1e-12) times 1 / FP8_MAX, and each value is x / scale clamped to FP8_MAX and
rounded to the nearest e4m3 value, ties to even. The kernel rounds in float32 itself and casts only values e4m3
holds exactly, so the result does not hang on how a backend rounds its own cast (the CPU interpreter's is not
round-to-nearest-even). The division is IEEE-rounded (div_rn), as torch's tensor division is, so the fp8 bytes
match the reference.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
GROUP = 128  # DeepSeek's activation group, the width of its weight blocks


@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, still float32.

    Adding and subtracting 2**23 times the e4m3 spacing at |v| leaves |v| rounded to that spacing, by float32's
    own round-to-nearest-even; the spacing is 2**(e - 3) for a normal exponent e and 2**-9 below 2**-6."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.abs(v)
    spacing_exp = tl.maximum(((bits >> 23) & 0xFF) - 3, 127 - 9)
    magic = ((spacing_exp + 23) << 23).to(tl.float32, bitcast=True)
    rounded = (mag + magic) - magic
    # v's own sign bit, so that -0.0 stays -0.0 as torch's cast keeps it
    return (rounded.to(tl.int32, bitcast=True) | (bits & -(2**31))).to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows(x, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(fp8 x, float32 scale per row) of a float32 tile [rows, group] whose columns are one group."""
    amax = tl.max(tl.abs(x), 1)
    # a multiply by the rounded reciprocal, as torch's division by a scalar is on CUDA (the reference's too)
    scale = tl.maximum(amax, 1e-12) * (1.0 / FP8_MAX)
    if POW2:  # the next power of two at or above the scale: its exponent, one up if any mantissa bit is set
        bits = scale.to(tl.int32, bitcast=True)
        up = tl.where((bits & 0x7FFFFF) != 0, 1 << 23, 0)
        scale = ((bits & 0x7F800000) + up).to(tl.float32, bitcast=True)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    return round_to_e4m3(q).to(tl.float8e4nv), scale


# The row count changes every step; specializing on it would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(
    X, Q, S, M, K, stride_xm, stride_qm, stride_sm, stride_sg, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = tl.arange(0, BLOCK_G)
    k = g * GROUP + cols
    m_ok = m < M
    ok = m_ok[:, None] & ((cols < GROUP) & (k < K))[None, :]
    rows = m[:, None].to(tl.int64)
    x = tl.load(X + rows * stride_xm + k[None, :], mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_rows(x, FP8_MAX, POW2)
    tl.store(Q + rows * stride_qm + k[None, :], q, mask=ok)
    tl.store(S + m.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=m_ok)


def quantize_per_token_group(
    x: torch.Tensor, group: int = GROUP, pow2_scale: bool = False, column_major_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, ceil(K/group)]) of a 2-D float x, one scale per token per `group` columns;
    pow2_scale rounds each scale up to a power of two (checkpoints with scale_fmt ue8m0). column_major_scale lays
    the scale out with its token dimension contiguous (strides 1, M), as cuBLASLt's 1x128 block scaling reads it."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token_group: takes 2-D x, not {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    if column_major_scale:
        scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return q, scale
    block_g = triton.next_power_of_2(group)
    block_m = max(1, min(16, 4096 // block_g))  # a few rows per program: the groups of one row are few
    _act_quant_kernel[(triton.cdiv(rows, block_m), groups)](
        x, q, scale, rows, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), GROUP=group, BLOCK_M=block_m,
        BLOCK_G=block_g, FP8_MAX=FP8_MAX, POW2=pow2_scale, num_warps=4, **pdl_launch(x),
    )  # fmt: skip
    return q, scale
