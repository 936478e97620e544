"""Skinny GEMMs, a few rows times a large weight (decode steps of small batches), as one Triton kernel for CUDA.

With one to sixteen rows a linear layer is a weight stream. On an H200 cuBLAS ran V2-Lite's decode projections at
one token near half the copy bandwidth (6.6 us per q / o / shared-expert projection) and split the kv_a projection
(576 outputs) into a GEMM plus a reduce kernel; the router's float32 gate took a copy, a dot and a reduce kernel
(benchmarks/h200_diagnose.py, host section). Here every program takes all rows as one 16-row tensor-core tile and
a narrow block of output columns, so the grid covers the GPU even for a few hundred outputs and each weight row
is read once. float32 weights (the router gate) take 16-bit rows widened in registers and float32 dots.

`skinny_linear_reference` is the torch definition it is tested against and the path for everything else.
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
    HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
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
        if WIDEN:  # 16-bit rows against a float32 weight
            a = a.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + m[:, None] * stride_om + n[None, :],
        acc.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def tile_for(n: int, k: int, weight_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): narrow column blocks so even a few hundred outputs spread over the SMs;
    wider ones for an LM head's tens of thousands. float32 weights take shorter K steps (twice the bytes)."""
    block_n = 16 if n <= 8192 else 64
    block_k = 256 if weight_dtype != torch.float32 else 128
    return block_n, min(block_k, triton.next_power_of_2(max(k, 16))), 4, 4


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T (+ bias) -> [M, N] in out_dtype (default x's dtype).

    16-bit weights take x in their dtype; a float32 weight widens x and computes in float32 (tl.dot's ieee mode,
    no tf32), as F.linear(x.float(), weight) does. tile overrides tile_for (sweeps)."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} with weight {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:  # a zero-size grid is not a valid launch
        return out
    block_n, block_k, warps, stages = tile or tile_for(n, k, weight.dtype)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else out, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, WIDEN=weight.dtype != x.dtype, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
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
