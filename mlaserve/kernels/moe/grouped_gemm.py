"""The tiled experts' GEMM: one grouped Triton GEMM per projection over pairs sorted by expert (sort.py), or over
pair tiles (one pair per tile, no sort). A program multiplies one BLOCK_M tile of the sorted list, which belongs to
one expert, by that expert's weight tile; the gated form computes SiLU(gate) * up in its epilogue.

Block-FP8 expert weights (layers/block_fp8.py's layout, one float32 scale per group_n rows per 128 columns) run
W8A16: each fp8 weight tile is widened to A's dtype in registers and each K step's dot scaled by its columns'
scales, which is exact because a K step (BLOCK_K divides 128) lies in one scale column. Given fp8 activations with
one float32 scale per row per 128 columns (fp8_quant.py), they run W8A8 instead: the dot takes both fp8 operands
and is scaled by the rows' scales too, the dense W8A8 GEMM's (fp8_prefill.py) scheme on sorted tiles.
"""

import functools

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fit import GemmTile, first_that_builds, gemm_tiles, shared_memory_limit
from mlaserve.kernels.pdl import pdl_enter, pdl_launch

SCALE_K = 128  # block-FP8 weights' scale columns are this wide


# The pair count changes every step; specializing on it (1, multiples of 16) would compile mid-serving.
@triton.jit(do_not_specialize=["num_valid"])
def _grouped_gemm(
    A, W, C, SortedIds, TileExpert, RouteW, WS, AS,
    num_valid, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm, stride_se, stride_sn, stride_asm,
    SCALED: tl.constexpr, A_SCALED: tl.constexpr, GROUP_N: tl.constexpr, SCALE_K: tl.constexpr, ROW_DIV: tl.constexpr, MUL_ROUTE: tl.constexpr, GATED: tl.constexpr, PAIR_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)  # before the early return: every program waits (pdl.py)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(TileExpert + pid_m).to(tl.int64)  # int64: expert * stride passes 2**31 for big models
    if expert < 0:  # a tile past the padded end of the sorted list
        return
    m = tl.arange(0, BLOCK_M)
    if PAIR_TILES:  # tile i is pair i alone (row 0); TileExpert is the routing itself, no sort was needed
        ids = tl.zeros([BLOCK_M], tl.int64) + pid_m
        ok = m == 0
    else:
        ids = tl.load(SortedIds + pid_m * BLOCK_M + m)
        ok = ids < num_valid
    rows = ids // ROW_DIV  # stage 1 reads the token's hidden state, stage 2 the pair's own row
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = W + expert * stride_we + n[None, :] * stride_wn
    s_gate = WS + expert * stride_se + (n // GROUP_N) * stride_sn
    s_up = WS + expert * stride_se + ((n + N) // GROUP_N) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(A + rows[:, None] * stride_am + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        w = tl.load(w_rows + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        if A_SCALED:  # fp8 x fp8: the step's dot scaled by its rows' and its columns' scales
            a_scale = tl.load(AS + rows * stride_asm + k0 // SCALE_K, mask=ok, other=0.0)[:, None]
            scale = tl.load(s_gate + k0 // SCALE_K, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * a_scale * scale[None, :]
        elif SCALED:  # fp8 weights: widened exactly to A's dtype, the dot scaled by this step's scale column
            scale = tl.load(s_gate + k0 // SCALE_K, mask=n_ok, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]
        else:
            acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows: both halves of one output column in a program
            up = tl.load(w_rows + N * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
            if A_SCALED:
                scale_up = tl.load(s_up + k0 // SCALE_K, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, up) * a_scale * scale_up[None, :]
            elif SCALED:
                scale_up = tl.load(s_up + k0 // SCALE_K, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, up.to(a.dtype), input_precision=PRECISION) * scale_up[None, :]
            else:
                acc_up += tl.dot(a, up, input_precision=PRECISION)
    if GATED:  # SiLU(gate) * up in the epilogue: the [pairs, 2I] gate_up tensor is never written
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTE:
        acc *= tl.load(RouteW + ids, mask=ok, other=0.0)[:, None]
    tl.store(
        C + ids[:, None] * stride_cm + n[None, :],
        acc.to(C.dtype.element_ty),
        mask=ok[:, None] & n_ok[None, :],
    )


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor | None,
    tile_expert: torch.Tensor,
    num_pairs: int,
    row_div: int,
    route_weights: torch.Tensor | None,
    block_m: int,
    gated: bool = False,
    tiles: tuple[GemmTile, ...] | None = None,
    scale: torch.Tensor | None = None,
    group_n: int = 128,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[pair] = a[pair // row_div] @ w[expert(pair)].T (times the pair's routing weight).

    gated: w holds gate rows then up rows and out[pair] = silu(gate) * up, half of w's rows wide.
    sorted_ids None: pair tiles, one pair per tile and tile_expert the flat routing (tiled.pair_tile_experts).
    tiles: the ladder to launch from (sweeps, tests); default tile_ladder's for the dtype and device.
    scale: w is block FP8 with this float32 scale [E, ceil(rows/group_n), ceil(K/128)]; each K step must divide 128.
    a_scale: a is fp8 too (W8A8), with this float32 scale [rows of a, ceil(K/128)]; out_dtype is then the output's
    dtype (a's otherwise)."""
    n, k = w.shape[1] // (2 if gated else 1), w.shape[2]
    if a_scale is not None and (scale is None or out_dtype is None):
        raise ValueError("grouped_gemm: fp8 activations take block-FP8 weights and an out_dtype")
    out = torch.empty(num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    if tiles is None:
        if a_scale is not None:
            tiles = fp8_tile_ladder(block_m, n, gated, shared_memory_limit(a.device))
        else:
            tiles = tile_ladder(block_m, n, k, a.element_size(), gated, shared_memory_limit(a.device))
    if scale is not None and any(SCALE_K % t.block_k for t in tiles):
        raise ValueError(f"grouped_gemm: block-FP8 weights take K steps that divide {SCALE_K}: {tiles}")
    if a_scale is not None and any(t.block_k < 32 for t in tiles):
        raise ValueError(f"grouped_gemm: an fp8 dot takes K steps of at least 32: {tiles}")
    scale_strides = (scale.stride(0), scale.stride(1)) if scale is not None else (0, 0)

    def launch(tile: GemmTile) -> None:
        _grouped_gemm[(tile_expert.numel(), triton.cdiv(n, tile.block_n))](
            a, w, out, tile_expert if sorted_ids is None else sorted_ids, tile_expert,
            route_weights if route_weights is not None else out, scale if scale is not None else out,
            a_scale if a_scale is not None else out,
            num_pairs, n, k,
            a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0), *scale_strides,
            a_scale.stride(0) if a_scale is not None else 0,
            SCALED=scale is not None, A_SCALED=a_scale is not None, GROUP_N=group_n, SCALE_K=SCALE_K, ROW_DIV=row_div, MUL_ROUTE=route_weights is not None, GATED=gated, PAIR_TILES=sorted_ids is None,
            BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=tile.warps,
            num_stages=tile.stages, **pdl_launch(a),
        )  # fmt: skip

    first_that_builds("grouped_gemm", tiles, launch)
    return out


def tile_config(block_m: int, k: int) -> GemmTile:
    """The tuned tile, from a sweep at V2-Lite's w13 shape in bf16:
    decode-sized 16-row tiles stream weights best with long K steps, 64-row tiles with wide N."""
    if block_m >= 128:
        block_n, block_k, warps, stages = 128, 64, 8, 3
    elif block_m >= 64:
        block_n, block_k, warps, stages = 128, 64, 4, 3
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    return GemmTile(block_n, min(block_k, triton.next_power_of_2(max(k, 16))), warps, stages)


@functools.lru_cache(maxsize=1024)
def tile_ladder(
    block_m: int, n: int, k: int, elem_bytes: int, gated: bool, limit: int
) -> tuple[GemmTile, ...]:
    """The tuned tile (no wider than the output), then smaller ones, from the first whose shared memory (A, and
    the weight tile or the gate and up tiles, per stage) fits `limit` for this element size: the tiles were tuned
    for bf16, and float32 doubles every buffer, past what a Hopper GPU gives a program at 64 rows and more."""
    tuned = tile_config(block_m, k)
    tuned = tuned._replace(block_n=min(tuned.block_n, max(16, triton.next_power_of_2(n))))
    return gemm_tiles(tuned, block_m, elem_bytes, 2 if gated else 1, limit)


def fp8_tile_config(block_m: int) -> GemmTile:
    """W8A8's first tile: a whole 128-wide scale group per K step (one load of each scale per step), fp8 operands
    taking half the shared memory of bf16 ones."""
    if block_m >= 128:
        return GemmTile(128, 128, 8, 3)
    if (
        block_m >= 64
    ):  # four stages: the fp8_tiles section's fastest at 64 rows on 1,024- and 4,096-token prompts
        return GemmTile(128, 128, 4, 4)
    return GemmTile(64, 128, 4, 4)


@functools.lru_cache(maxsize=1024)
def fp8_tile_ladder(block_m: int, n: int, gated: bool, limit: int) -> tuple[GemmTile, ...]:
    """fp8_tile_config's tile (no wider than the output), then smaller ones whose K steps stay from 128 down to an
    fp8 dot's 32, from the first whose one-byte tiles fit `limit`."""
    first = fp8_tile_config(block_m)
    first = first._replace(block_n=min(first.block_n, max(16, triton.next_power_of_2(n))))
    rungs = tuple(t for t in gemm_tiles(first, block_m, 1, 2 if gated else 1, limit) if t.block_k >= 32)
    return rungs or (first._replace(block_k=32, stages=1),)
