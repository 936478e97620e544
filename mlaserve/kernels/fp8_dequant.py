"""Block-FP8 weights dequantized to a 16-bit or float32 weight on the GPU, one Triton launch: the other half of
the "dequantize, then cuBLAS" candidate for prefill-sized batches (`dequant_linear`), which reads the fp8 weight
once and writes it back at twice its bytes, and then runs at the dense 16-bit GEMM's rate.

layers/block_fp8.dequantize is the reference: the float32 product of each fp8 value and its block's scale, rounded
once to the output dtype, so the two agree to the bit.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.kernels.fp8_quant import GROUP
from mlaserve.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _dequant_kernel(
    W, S, Out, N, K, stride_wn, stride_sn, stride_on,
    GROUP_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1)
    k = kb * SCALE_K + tl.arange(0, SCALE_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    rows = n[:, None].to(tl.int64)
    w = tl.load(W + rows * stride_wn + k[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(S + (n // GROUP_N).to(tl.int64) * stride_sn + kb, mask=n < N, other=0.0)
    tl.store(Out + rows * stride_on + k[None, :], (w * s[:, None]).to(Out.dtype.element_ty), mask=ok)


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, group_n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The [N, K] weight in `dtype` that an fp8 weight with its float32 scale per group_n x 128 block stands for."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if out.numel() == 0:
        return out
    block_n = 32
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, GROUP))](
        weight, scale, out, n, k, weight.stride(0), scale.stride(0), out.stride(0),
        GROUP_N=group_n, SCALE_K=GROUP, BLOCK_N=block_n, num_warps=4, **pdl_launch(weight),
    )  # fmt: skip
    return out


def dequant_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantize(weight, scale)^T (+ bias) with the weight dequantized to x's dtype for this call alone."""
    return F.linear(x, dequantize_weight(weight, scale, group_n, x.dtype), bias)
