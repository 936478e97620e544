"""W8A16 decode GEMMs for block-FP8 weights: a few rows of x (16-bit or float32) times an fp8 weight [N, K], the
weight widened in registers and each 128-wide K chunk's partial sums scaled by its block's scale.

With one to sixteen rows the weight's bytes are the cost, so these are skinny.py's two kernels over fp8 weights:
up to GEMV_MAX_ROWS rows `_fp8_gemv_kernel` loads blocks of a few whole weight rows (up to 2,048 columns, the next
block while it sums this one) as [rows, chunks, 128] tiles, sums every input row against each 128-wide chunk in
registers and scales the chunk sums by their [rows, chunks] scales; from 5 to 16 rows `_fp8_tile_kernel` takes all
rows as one 16-row tensor-core tile and steps K by at most 128 (one scale column per step), scaling each step's dot.
Past 16 rows the same tile kernel takes 32- or 64-row tiles, one program per row block and column block: a
candidate beside the W8A8 GEMM for small batches, which block_fp8.py's table takes where measured faster.
Activations are not quantized, so the result differs from the dequantized weight's product only by summation order.
"""

import functools

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fit import GemmTile, first_that_builds, gemm_tiles, shared_memory_limit
from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kernels.registry import GEMV_MAX_ROWS, LM_HEAD_WIDTH, SKINNY_MAX_ROWS

SCALE_K = 128  # the published block width: one weight scale per 128 columns


# The row count changes every step; specializing on it would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    X, W, S, Bias, Out, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    c = tl.arange(0, CHUNKS)
    j = tl.arange(0, SCALE_K)
    k = c[:, None] * SCALE_K + j[None, :]  # [CHUNKS, SCALE_K]: one row per scale column
    w_rows = W + n[:, None, None].to(tl.int64) * stride_wn
    s_rows = S + (n // GROUP_N)[:, None].to(tl.int64) * stride_sn
    k_blocks = tl.cdiv(K, SCALE_K)
    # The first weight block and its scales load before the wait: weights are never written during a step.
    w = tl.load(w_rows + k[None, :, :], mask=n_ok[:, None, None] & (k < K)[None, :, :], other=0.0)
    s = tl.load(s_rows + c[None, :], mask=n_ok[:, None] & (c < k_blocks)[None, :], other=0.0)
    pdl_enter(PDL)
    m = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, CHUNKS * SCALE_K):
        kk = k0 + k
        w32 = w.to(tl.float32)
        for r in tl.static_range(ROWS):
            if r < M:
                x = tl.load(X + r * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
                chunk_sums = tl.sum(w32 * x[None, :, :], 2)  # [BLOCK_N, CHUNKS]
                row = tl.sum(chunk_sums * s, 1)
                acc = tl.where(m[:, None] == r, acc + row[None, :], acc)
        # the next block and its scales, loading while the next step's sums wait on them (masked past K)
        nk = kk + CHUNKS * SCALE_K
        nc = (k0 + CHUNKS * SCALE_K) // SCALE_K + c
        w = tl.load(w_rows + nk[None, :, :], mask=n_ok[:, None, None] & (nk < K)[None, :, :], other=0.0)
        s = tl.load(s_rows + nc[None, :], mask=n_ok[:, None] & (nc < k_blocks)[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Out + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])


def gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, CHUNKS): whole rows up to 2,048 columns in 128-wide chunks, about 16k weights per program (their
    float32 copy is what fills the registers), never more rows than the output has."""
    block_k = min(triton.next_power_of_2(max(k, SCALE_K)), 2048)
    return max(8, min(16384 // block_k, triton.next_power_of_2(n))), block_k // SCALE_K


# The row count changes every step; specializing on it (multiples of 16) would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _fp8_tile_kernel(
    X, W, S, Bias, Out, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_cols = W + n[None, :].to(tl.int64) * stride_wn  # int64: an LM head's rows times K pass 2**31
    s_cols = S + (n // GROUP_N).to(tl.int64) * stride_sn
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides SCALE_K: each step lies in one scale column
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        s = tl.load(s_cols + k0 // SCALE_K, mask=n_ok, other=0.0)
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * s[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + m[:, None] * stride_om + n[None, :],
        acc.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def tile_for(n: int, block_m: int = SKINNY_MAX_ROWS) -> GemmTile:
    """skinny.py's tiles with K steps of one scale column: 16 output columns, 64 for LM-head widths; 64 columns
    for row tiles taller than 16, where more rows share each weight tile."""
    if n >= LM_HEAD_WIDTH:
        return GemmTile(64, SCALE_K, 4, 4)
    if block_m > SKINNY_MAX_ROWS:
        return GemmTile(64, SCALE_K, 4, 3)
    return GemmTile(16, SCALE_K, 4, 4)


def block_m_for(rows: int) -> int:
    """Rows per tile: one 16-row tile up to 16 rows, 32 up to 32, 64 beyond."""
    return min(64, max(SKINNY_MAX_ROWS, triton.next_power_of_2(rows)))


@functools.lru_cache(maxsize=1024)
def tile_ladder(
    first: GemmTile, k: int, elem_bytes: int, limit: int, block_m: int = SKINNY_MAX_ROWS
) -> tuple[GemmTile, ...]:
    """`first` with its K step no deeper than one scale column or K, then smaller tiles (each K step still divides
    the scale column), from the first whose block_m-row input tile and weight tile per stage fit `limit`; the
    weight is counted at the input's element size, which is what it widens to."""
    depth = min(first.block_k, SCALE_K, triton.next_power_of_2(max(k, 16)))
    return gemm_tiles(first._replace(block_k=depth), block_m, elem_bytes, 1, limit)


def w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """out [M, N] = x @ (weight * scale)^T (+ bias), x and weight contiguous in their last dimension; the GEMV up
    to GEMV_MAX_ROWS rows, the tile kernel above (or whenever `tile` is given), in row tiles of block_m_for(M)."""
    rows, k = x.shape
    n = weight.shape[0]
    common = (x, weight, scale, bias if bias is not None else out, out, rows, n, k)
    strides = (x.stride(0), weight.stride(0), scale.stride(0), out.stride(0))
    if rows <= GEMV_MAX_ROWS and tile is None:
        block_n, chunks = gemv_blocks(n, k)
        _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
            *common, *strides, GROUP_N=group_n, HAS_BIAS=bias is not None, ROWS=GEMV_MAX_ROWS, BLOCK_N=block_n,
            CHUNKS=chunks, SCALE_K=SCALE_K, num_warps=4, **pdl_launch(x),
        )  # fmt: skip
        return out
    block_m = block_m_for(rows)
    first = GemmTile(*(tile or tile_for(n, block_m)))
    tiles = tile_ladder(first, k, x.element_size(), shared_memory_limit(x.device), block_m)

    def launch(t: GemmTile) -> None:
        _fp8_tile_kernel[(triton.cdiv(n, t.block_n), triton.cdiv(rows, block_m))](
            *common, *strides, GROUP_N=group_n, HAS_BIAS=bias is not None, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, SCALE_K=SCALE_K, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, num_warps=t.warps, num_stages=t.stages, **pdl_launch(x),
        )  # fmt: skip

    first_that_builds("fp8_w8a16", tiles, launch)
    return out
