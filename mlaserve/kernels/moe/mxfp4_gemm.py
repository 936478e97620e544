"""DeepSeek-V4's MXFP4 routed experts on the GPU, weight-only: the grouped GEMM of grouped_gemm.py over pairs sorted
by expert (or one pair per tile), its weight tiles read as packed e2m1 bytes and e8m0 scales (layers/mxfp4.py) and
widened to the activations' dtype in registers, so the experts stay at half a byte per value in memory.

A packed byte holds columns 2j (low nibble) and 2j + 1 (high nibble): a K step multiplies the even columns of A by
the low nibbles and the odd columns by the high ones, two dots over the same bytes, with no interleaving in
registers. Every value times its scale is exact in bf16 and float32 (three significant bits times a power of two).
The gated stage computes V4's SwiGLU (the gate clamped from above, the up projection on both sides) in its
epilogue; the down stage weighs each pair by its routing weight; combine.py sums each token's pairs.
mxfp4_experts.experts_reference (layers/) is the torch loop it is tested against.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.moe.combine import combine
from mlaserve.kernels.moe.dispatch import pair_tiles_pay
from mlaserve.kernels.moe.sort import sort_by_expert
from mlaserve.kernels.moe.tiled import sorted_tile_rows
from mlaserve.kernels.pdl import pdl_enter, pdl_launch

GROUP = 32  # columns per e8m0 scale: 16 packed bytes
BLOCK_N, BLOCK_K, WARPS, STAGES = 64, 64, 4, 2


@triton.jit
def _e2m1(code):
    """The float32 value of 4-bit e2m1 codes (int32): sign, 2 exponent bits, 1 mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    mantissa = (code & 1).to(tl.float32)
    exponent = (code >> 1) & 3
    magnitude = tl.where(
        exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32))
    )
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _packed_tile(W, S, w_rows, s_rows, kp, mask):
    """The (even-column, odd-column) float32 weight tiles [HALF, BLOCK_N] of packed bytes kp of rows w_rows."""
    byte = tl.load(W + w_rows + kp[:, None], mask=mask, other=0).to(tl.int32)
    exponent = tl.load(S + s_rows + kp[:, None] // 16, mask=mask, other=127).to(tl.float32)
    scale = tl.exp2(exponent - 127.0)
    return _e2m1(byte & 15) * scale, _e2m1(byte >> 4) * scale


# The pair count changes every step; specializing on it would compile mid-serving.
@triton.jit(do_not_specialize=["num_valid"])
def _mxfp4_grouped_gemm(
    A, W, S, C, SortedIds, TileExpert, RouteW,
    num_valid, N, K, limit,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    ROW_DIV: tl.constexpr, MUL_ROUTE: tl.constexpr, GATED: tl.constexpr, PAIR_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(TileExpert + pid_m).to(tl.int64)
    if expert < 0:  # a tile past the padded end of the sorted list, or another rank's route
        return
    m = tl.arange(0, BLOCK_M)
    if PAIR_TILES:
        ids = tl.zeros([BLOCK_M], tl.int64) + pid_m
        ok = m == 0
    else:
        ids = tl.load(SortedIds + pid_m * BLOCK_M + m)
        ok = ids < num_valid
    rows = ids // ROW_DIV
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = expert * stride_we + n[None, :] * stride_wn
    s_rows = expert * stride_se + n[None, :] * stride_sn
    half = K // 2
    for k0 in range(0, half, BLOCK_K // 2):
        kp = k0 + tl.arange(0, BLOCK_K // 2)  # packed bytes: columns 2 kp and 2 kp + 1
        kp_ok = kp < half
        a_mask = ok[:, None] & kp_ok[None, :]
        a_row = A + rows[:, None] * stride_am + 2 * kp[None, :]
        a_even = tl.load(a_row, mask=a_mask, other=0.0)
        a_odd = tl.load(a_row + 1, mask=a_mask, other=0.0)
        mask = n_ok[None, :] & kp_ok[:, None]
        lo, hi = _packed_tile(W, S, w_rows, s_rows, kp, mask)
        acc += tl.dot(a_even, lo.to(a_even.dtype), input_precision=PRECISION)
        acc += tl.dot(a_odd, hi.to(a_odd.dtype), input_precision=PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows
            lo, hi = _packed_tile(W, S, w_rows + N * stride_wn, s_rows + N * stride_sn, kp, mask)
            acc_up += tl.dot(a_even, lo.to(a_even.dtype), input_precision=PRECISION)
            acc_up += tl.dot(a_odd, hi.to(a_odd.dtype), input_precision=PRECISION)
    if GATED:  # V4's SwiGLU in the epilogue
        gate = tl.minimum(acc, limit)
        acc = gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(acc_up, -limit), limit)
    if MUL_ROUTE:
        acc *= tl.load(RouteW + ids, mask=ok, other=0.0)[:, None]
    tl.store(
        C + ids[:, None] * stride_cm + n[None, :],
        acc.to(C.dtype.element_ty),
        mask=ok[:, None] & n_ok[None, :],
    )


def mxfp4_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    sorted_ids: torch.Tensor | None,
    tile_expert: torch.Tensor,
    num_pairs: int,
    row_div: int,
    route_weights: torch.Tensor | None,
    block_m: int,
    gated: bool = False,
    limit: float = float("inf"),
) -> torch.Tensor:
    """out[pair] = a[pair // row_div] @ dequantize(w[expert(pair)], scale[...]).T (times the pair's routing weight),
    w packed uint8 [E, rows, K / 2], scale e8m0 uint8 [E, rows, K / 32]. gated: rows are gate then up, and out is
    V4's clamped SwiGLU of the two, half as wide."""
    n, k = w.shape[1] // (2 if gated else 1), 2 * w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    _mxfp4_grouped_gemm[(tile_expert.numel(), triton.cdiv(n, BLOCK_N))](
        a, w, scale, out, tile_expert if sorted_ids is None else sorted_ids, tile_expert,
        route_weights if route_weights is not None else out,
        num_pairs, n, k, limit,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        ROW_DIV=row_div, MUL_ROUTE=route_weights is not None, GATED=gated, PAIR_TILES=sorted_ids is None,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=WARPS, num_stages=STAGES,
        **pdl_launch(a),
    )  # fmt: skip
    return out


def mxfp4_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """experts_reference's contract (layers/mxfp4_experts.py): the routed experts' weighted sum per token, the
    routing kept on the device (a decode step stays capturable)."""
    num_pairs, top_k, num_experts = ids.numel(), ids.shape[1], w13.shape[0]
    if pair_tiles_pay(num_pairs, num_experts):
        block_m, sorted_ids, tile_expert = 16, None, ids.flatten()
    else:
        block_m = sorted_tile_rows(num_pairs, num_experts)
        sorted_ids, tile_expert = sort_by_expert(ids, num_experts, block_m)
    x = x.contiguous()
    hidden = mxfp4_grouped_gemm(
        x, w13, w13_scale, sorted_ids, tile_expert, num_pairs, top_k, None, block_m, True, limit
    )
    route = weights.flatten().float().contiguous()
    down = mxfp4_grouped_gemm(hidden, w2, w2_scale, sorted_ids, tile_expert, num_pairs, 1, route, block_m)
    return combine(down, top_k, None)
