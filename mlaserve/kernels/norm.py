"""Fused RMSNorm (optionally with the residual add before it) as one Triton kernel, for CUDA.

In eager torch an RMSNorm is about six small kernels (cast, square, mean, rsqrt, scale, weight) and the residual
add before it one more; in a decode step with a few tokens these are pure launch latency. One program per row
does the whole thing with the row in registers. The rounding points follow `rms_norm_reference` in norm.py
(residual sum rounded to x's dtype, normalised row rounded to x's dtype, weight multiply in the promoted dtype), so the
result differs from the reference only by the fp32 summation order. No host syncs: capturable in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, HOut,
    stride_x, stride_r, stride_o, stride_h,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 in a long prefill
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait (pdl.py)
    pdl_enter(PDL)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        # Added in fp32 and rounded to x's dtype, as torch's `hidden + attn_out` is: the stream the next layer
        # sees and the row normalised here must be the same rounded values.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(HOut + row * stride_h + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing; divide by the true width, not BLOCK_N.
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    # The reference rounds the normalised row back to x's dtype before the weight multiply.
    normed = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _num_warps(block_n: int) -> int:
    # About 8 fp32 values per thread: enough work per thread without spilling a 16k-wide row.
    return min(max(block_n // 256, 1), 16)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x ([T, N]) or, with residual, of h = x + residual; returns (normed, h or None).

    Rows of x and residual may be strided (a column slice of a wider tensor); the outputs are contiguous.
    """
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    shape = x.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    rows = x2.shape[0]
    # The same dtype `weight * x` gives in the reference: fp32 when one of them is fp32.
    out = torch.empty(rows, n, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = r2 = None
    if residual is not None:
        r2 = residual if residual.dim() == 2 else residual.reshape(-1, n)
        h = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows > 0:  # a zero-size grid is not a valid launch
        block_n = triton.next_power_of_2(n)
        # Without a residual the kernel never touches Res/HOut; x and out stand in for them.
        _rms_norm_kernel[(rows,)](
            x2, x2 if r2 is None else r2, weight.contiguous(), out, out if h is None else h,
            x2.stride(0), 0 if r2 is None else r2.stride(0), out.stride(0), 0 if h is None else h.stride(0),
            n, eps,
            HAS_RESIDUAL=h is not None, BLOCK_N=block_n, num_warps=_num_warps(block_n), **pdl_launch(x2),
        )  # fmt: skip
    return out.view(shape), (None if h is None else h.view(shape))
