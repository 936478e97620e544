"""Skinny GEMMs, a few rows times a large weight (decode steps of small batches), as Triton kernels for CUDA.

With one to sixteen rows a linear layer is a weight stream. Up to GEMV_MAX_ROWS rows `_gemv_kernel` takes it: each
program loads a block of 8-128 whole weight rows (up to 2,048 columns at once, the next block while it sums this one)
before it waits for its input (programmatic dependent launch, pdl.py), then sums every input row against it in
registers. Inside a CUDA graph it beat cuBLAS at these row counts, so it takes every such linear layer. The same kernel
runs per-head products (MLA's absorbed W_UK and W_UV: one weight matrix per head) with the head as a second grid axis.

From 5 to 16 rows `_skinny_kernel` takes all rows as one 16-row tensor-core tile and a narrow block of output columns,
so the grid covers the GPU even for a few hundred outputs and each weight row is read once. Against cuBLAS inside CUDA
graphs over weights beyond L2 it won where cuBLAS is weakest: narrow outputs, which cuBLAS splits over K into a GEMM
plus a reduce kernel, and LM-head-wide ones. For the widths in between cuBLAS was as fast or faster, so the registry
sends only the first two kinds there (registry.SKINNY_LINEAR). LM heads keep that kernel at any row count.

`skinny_linear_reference` and `per_head_reference` are the torch definitions they are tested against.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.kernels.fit import GemmTile, first_that_builds, gemm_tiles, shared_memory_limit
from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kernels.registry import GEMV_MAX_ROWS, LM_HEAD_WIDTH, SKINNY_MAX_ROWS


# The row count changes every step; specializing on it would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    X, W, Bias, Out, M, N, K,
    stride_xm, stride_xh, stride_wh, stride_wn, stride_om, stride_oh,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1).to(tl.int64)  # the head of a per-head product; 0 for a linear layer
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = W + h * stride_wh + n[:, None].to(tl.int64) * stride_wn
    # The first weight block is loaded before the wait: weights are never written by the kernels before this one.
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    pdl_enter(PDL)
    m = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    x_rows = X + h * stride_xh
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w32 = w.to(tl.float32)
        for r in tl.static_range(ROWS):
            if r < M:
                x = tl.load(x_rows + r * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
                acc = tl.where(m[:, None] == r, acc + tl.sum(w32 * x[None, :], 1)[None, :], acc)
        nk = kk + BLOCK_K  # the next block, loading while the next step's sums wait on it (masked past K)
        w = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk < K)[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Out + h * stride_oh + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])


def _gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): whole rows up to 2,048 columns, about 16k weights per program (8 rows of 2,048, 128 of
    128), never more rows than the output has."""
    block_k = min(triton.next_power_of_2(max(k, 16)), 2048)
    return max(8, min(16384 // block_k, triton.next_power_of_2(n))), block_k


def _gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out [M, H, N] = x [M, H, K] @ w [H, N, K]^T per head (+ bias [N]); last dimensions contiguous."""
    rows, heads, k = x.shape
    n = w.shape[1]
    block_n, block_k = _gemv_blocks(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n), heads)](
        x, w, bias if bias is not None else out, out, rows, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ROWS=GEMV_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl_launch(x),
    )  # fmt: skip
    return out


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T <= GEMV_MAX_ROWS, H, K] @ w [H, N, K]^T per head -> [T, H, N] (einsum "thk,hnk->thn"), 16-bit x and w
    of one dtype; x may be a strided view whose last dimension is contiguous (MLA's q[..., :nope])."""
    rows, heads, k = x.shape
    if (
        rows > GEMV_MAX_ROWS
        or w.shape[0] != heads
        or w.shape[2] != k
        or x.dtype != w.dtype
        or x.dtype == torch.float32
    ):
        raise ValueError(f"per_head: x {tuple(x.shape)} {x.dtype} with w {tuple(w.shape)} {w.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(rows, heads, w.shape[1], dtype=x.dtype, device=x.device)
    return out if rows == 0 else _gemv(x, w, None, out)


def per_head_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thk,hnk->thn", x, w)


# The row count changes every step; specializing on it (1, multiples of 16) would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    X, W, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
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


def tile_for(n: int) -> GemmTile:
    """The sweep's best tile for 16-bit weights: long K steps and 16 columns for narrow outputs, 64 columns for
    LM-head widths, 2 warps on 16 columns for the widths between."""
    if n <= 1024:
        return GemmTile(16, 512, 4, 3)
    if n >= LM_HEAD_WIDTH:
        return GemmTile(64, 128, 4, 4)
    return GemmTile(16, 256, 2, 4)


@functools.lru_cache(maxsize=1024)
def tile_ladder(first: GemmTile, k: int, elem_bytes: int, limit: int) -> tuple[GemmTile, ...]:
    """`first` with its K step no deeper than K, then smaller tiles, from the first that fits `limit` (the
    16-row input tile and the weight tile, per stage)."""
    first = first._replace(block_k=min(first.block_k, triton.next_power_of_2(max(k, 16))))
    return gemm_tiles(first, SKINNY_MAX_ROWS, elem_bytes, 1, limit)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T (+ bias) -> [M, N], 16-bit x and weight of one dtype. tile overrides
    tile_for (sweeps); either is shrunk to fit the device."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > SKINNY_MAX_ROWS or weight.shape[1] != k or x.dtype != weight.dtype or x.dtype == torch.float32:
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
    if rows <= GEMV_MAX_ROWS and n < LM_HEAD_WIDTH and tile is None:
        return _gemv(x.unsqueeze(1), weight.unsqueeze(0), bias, out.unsqueeze(1)).squeeze(1)
    tiles = tile_ladder(GemmTile(*(tile or tile_for(n))), k, x.element_size(), shared_memory_limit(x.device))

    def launch(t: GemmTile) -> None:
        _skinny_kernel[(triton.cdiv(n, t.block_n),)](
            x, weight, bias if bias is not None else out, out, rows, n, k, x.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps,
            num_stages=t.stages, **pdl_launch(x),
        )  # fmt: skip

    first_that_builds("skinny_linear", tiles, launch)
    return out


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = F.linear(x.to(weight.dtype), weight, bias)
    return out.to(out_dtype or x.dtype)
