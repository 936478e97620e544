"""The W8A8 block-FP8 GEMM of prefill-sized batches: fp8 activations (one scale per token per 128 columns,
fp8_quant.py) times an fp8 weight [N, K] (one scale per group_n rows per 128 columns), `tl.dot` on the fp8
operands with a float32 accumulator, each K step's dot scaled by its row and column scales.

A K step never crosses a scale column (BLOCK_K divides 128), so acc += dot * a_scale[:, None] * w_scale[None, :]
is the dequantized product exactly up to summation order. With QUANT_A the kernel reads x itself and quantizes
each 128-wide A tile as it loads it (the same numbers as fp8_quant's kernel), so no fp8 copy of x is written; its
steps are then whole groups (BLOCK_K = 128), and every column block of the output quantizes the same rows again.
"""

import functools

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fit import GemmTile, first_that_builds, fitting, ladder, shared_memory_limit
from mlaserve.kernels.fp8_quant import FP8_MAX, GROUP, quantize_per_token_group, quantize_rows
from mlaserve.kernels.pdl import pdl_enter, pdl_launch


# The row count changes every step; specializing on it would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    A, AS, W, WS, Bias, Out, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    GROUP_N: tl.constexpr, QUANT_A: tl.constexpr, POW2: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_K: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    # Programs walk GROUP_M row blocks down one column block before moving right, so a weight tile is read from
    # L2 by the row blocks that share it.
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = pid // per_group * GROUP_M
    height = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % height
    pid_n = (pid % per_group) // height
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    a_rows = A + m[:, None].to(tl.int64) * stride_am
    as_rows = AS + m.to(tl.int64) * stride_asm
    w_cols = W + n[None, :].to(tl.int64) * stride_wn
    ws_cols = WS + (n // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT_A:  # the step is one whole group: quantize it here as fp8_quant's kernel would
            a, a_scale = quantize_rows(a.to(tl.float32), FP8_MAX, POW2)
        else:
            a_scale = tl.load(as_rows + k0 // SCALE_K, mask=m_ok, other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        w_scale = tl.load(ws_cols + k0 // SCALE_K, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Out + m[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_m_for(rows: int) -> int:
    """Rows per tile: one Hopper warpgroup's 64 up to 64 rows, 128 beyond."""
    return 64 if rows <= 64 else 128


def tile_for(block_m: int) -> GemmTile:
    """Whole scale blocks per step (128 columns of 128 rows), a warp per 16 rows of A."""
    return GemmTile(128, GROUP, 4 if block_m <= 64 else 8, 3)


def _shrink(tile: GemmTile, fused: bool) -> GemmTile | None:
    """Fewer stages, then (separately quantized A only) a shallower K step down to an fp8 dot's 32, then
    narrower N down to 16 columns, then no pipelining."""
    n, k, warps, stages = tile
    if stages > 2:
        return tile._replace(stages=stages - 1)
    if k > 32 and not fused:
        return tile._replace(block_k=k // 2)
    if n > 16:
        return tile._replace(block_n=n // 2)
    if stages > 1:
        return tile._replace(stages=1)
    return None


@functools.lru_cache(maxsize=1024)
def tile_ladder(block_m: int, n: int, a_bytes: int, fused: bool, limit: int) -> tuple[GemmTile, ...]:
    """The tile for block_m (no wider than the output), then smaller ones, from the first whose A tile (a_bytes
    per element: x's when quantized in the kernel) and fp8 weight tile per stage fit `limit`."""
    first = tile_for(block_m)
    first = first._replace(block_n=min(first.block_n, max(16, triton.next_power_of_2(n))))

    def shared_bytes(t: GemmTile) -> int:
        return t.stages * t.block_k * (a_bytes * block_m + t.block_n)

    return fitting(ladder(first, lambda t: _shrink(t, fused)), shared_bytes, limit)


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    fuse_quant: bool = False,
    pow2_scale: bool = False,
    tiles: tuple[GemmTile, ...] | None = None,
    block_m: int | None = None,
    group_m: int = 8,
) -> torch.Tensor:
    """out [M, N] = quantize_per_token_group(x) @ (weight * scale)^T (+ bias), in float32 and rounded once.

    fuse_quant: quantize A inside the GEMM instead of a separate pass. tiles, block_m, group_m: the ladder to
    launch from, rows per tile and row blocks per column sweep (tests, sweeps); default tile_ladder's for the
    device and block_m_for's rows."""
    rows, k = x.shape
    n = weight.shape[0]
    block_m = block_m or block_m_for(rows)
    if fuse_quant:
        a, a_scale = x, x  # the scale pointer is never read
    else:
        a, a_scale = quantize_per_token_group(x, GROUP, pow2_scale)
    if tiles is None:
        tiles = tile_ladder(block_m, n, a.element_size(), fuse_quant, shared_memory_limit(x.device))
    if any(GROUP % t.block_k or (fuse_quant and t.block_k != GROUP) for t in tiles):
        raise ValueError(f"w8a8_linear: K steps must divide {GROUP} (equal it with fuse_quant): {tiles}")

    def launch(t: GemmTile) -> None:
        grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, t.block_n),)
        _w8a8_kernel[grid](
            a, a_scale, weight, scale, bias if bias is not None else out, out, rows, n, k,
            a.stride(0), a_scale.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            GROUP_N=group_n, QUANT_A=fuse_quant, POW2=pow2_scale, HAS_BIAS=bias is not None, BLOCK_M=block_m,
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=group_m, SCALE_K=GROUP, FP8_MAX=FP8_MAX,
            num_warps=t.warps, num_stages=t.stages, **pdl_launch(x),
        )  # fmt: skip

    first_that_builds("fp8_w8a8", tiles, launch)
    return out
