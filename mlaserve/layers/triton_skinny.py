"""Skinny GEMMs, a few rows times a large weight (decode steps of small batches), as one Triton kernel for CUDA.

With one to sixteen rows a linear layer is a weight stream. Every program here takes all rows as one 16-row
tensor-core tile and a narrow block of output columns, so the grid covers the GPU even for a few hundred outputs
and each weight row is read once. Against cuBLAS on an H200, inside CUDA graphs over weights beyond L2
(benchmarks/diagnose/h200_diagnose.py, skinny section), it won where cuBLAS is weakest: narrow outputs, which
cuBLAS splits over K into a GEMM plus a reduce kernel (V2-Lite's 576-wide kv_a projection: 5.1 vs 6.0 us), and
LM-head-wide ones (102,400 x 2,048: 106 vs 115 us). For the widths in between cuBLAS was as fast or faster
(q_proj 6.5 vs 6.8 us), so linear.py sends only the first two kinds here.

`skinny_linear_reference` is the torch definition it is tested against.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16  # one tensor-core tile of rows; larger batches keep cuBLAS


# The row count changes every step; specializing on it (1, multiples of 16) would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    X, W, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, 16)
    m_ok = m < M
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    w_cols = W + n[None, :].to(tl.int64) * stride_wn  # int64: the LM head's rows times K pass 2**31
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + m[:, None] * stride_om + n[None, :],
        acc.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def tile_for(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), the sweep's best: long K steps and 16 columns for narrow outputs, 64
    columns for LM-head widths, 2 warps on 16 columns for the widths between."""
    if n <= 1024:
        return 16, 512, 4, 3
    if n >= 32768:
        return 64, 128, 4, 4
    return 16, 256, 2, 4


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T (+ bias) -> [M, N], 16-bit x and weight of one dtype. tile overrides
    tile_for (sweeps)."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != k or x.dtype != weight.dtype or x.dtype == torch.float32:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)} {weight.dtype}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:  # a zero-size grid is not a valid launch
        return out
    block_n, block_k, warps, stages = tile or tile_for(n)
    block_k = min(block_k, triton.next_power_of_2(max(k, 16)))
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else out, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = F.linear(x.to(weight.dtype), weight, bias)
    return out.to(out_dtype or x.dtype)
