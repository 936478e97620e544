"""The experts as tiled Triton GEMMs (grouped_gemm.py): pairs sorted by expert into tiles of one expert each
(sort.py), or, for a handful of pairs over many experts, one pair per tile and no sort at all. The routing stays on
the device, so a decode step can be captured in a CUDA graph. moe.experts_reference (layers/) is the plain
per-expert loop they are tested against. Block-FP8 expert weights come with their scales (Fp8Scales) and run
W8A16 in the same GEMMs, or W8A8 (w8a8_tile_experts): each GEMM's input quantized per token in groups of 128
columns first (fp8_quant.py), x once per token and the gated activations once per pair, and the dots on fp8.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mlaserve.kernels.fit import GemmTile
from mlaserve.kernels.fp8_quant import GROUP, quantize_per_token_group
from mlaserve.kernels.moe.combine import combine
from mlaserve.kernels.moe.gated import act_and_mul, silu_and_mul
from mlaserve.kernels.moe.grouped_gemm import grouped_gemm
from mlaserve.kernels.moe.sort import sort_by_expert


class Fp8Scales(NamedTuple):
    """The float32 block scales of fp8 w13 [E, ceil(2I/group_n), ceil(H/128)] and w2 [E, ceil(H/group_n),
    ceil(I/128)]."""

    w13: torch.Tensor
    w2: torch.Tensor
    group_n: int


def sorted_tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per sorted tile. Tensor-core tiles are 64 rows tall, so 16-row tiles waste most of each multiply once
    experts get more than a few rows; 32-row tiles from 16 rows per expert were faster than either 16 or 64 rows
    in a mixed workload; 64-row tiles from 32; 128-row tiles once experts average 128 (long prefills)."""
    if num_pairs >= 128 * num_experts:
        return 128
    if num_pairs >= 32 * num_experts:
        return 64
    return 32 if num_pairs >= 16 * num_experts else 16


def _experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    add: torch.Tensor | None,
    block_m: int,
    sorted_ids: torch.Tensor | None,
    tile_expert: torch.Tensor,
    fp8: Fp8Scales | None,
    w8a8: bool = False,
    fuse_gate: bool = True,
    tiles: tuple[GemmTile, ...] | None = None,
) -> torch.Tensor:
    num_pairs, top_k = ids.numel(), ids.shape[1]
    group_n = fp8.group_n if fp8 is not None else 128
    up_scale, down_scale = (fp8.w13, fp8.w2) if fp8 is not None else (None, None)
    gated = act is F.silu and fuse_gate
    a, a_scale = quantize_per_token_group(x, GROUP) if w8a8 else (x, None)
    hidden = grouped_gemm(
        a, w13, sorted_ids, tile_expert, num_pairs, top_k, None, block_m, gated, tiles, up_scale, group_n,
        a_scale, x.dtype,
    )  # fmt: skip
    if not gated:
        hidden = silu_and_mul(hidden) if act is F.silu else act_and_mul(hidden, act)
    h_scale = None
    if w8a8:
        hidden, h_scale = quantize_per_token_group(hidden, GROUP)
    route = weights.flatten().float().contiguous()
    down = grouped_gemm(
        hidden, w2, sorted_ids, tile_expert, num_pairs, 1, route, block_m, False, tiles, down_scale, group_n,
        h_scale, x.dtype,
    )  # fmt: skip
    return combine(down, top_k, add)


def pair_tile_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    add: torch.Tensor | None = None,
    fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """dispatch.fused_experts' contract, one pair per 16-row tile: the routing itself is each tile's expert."""
    return _experts(x, w13, w2, weights, ids, act, add, 16, None, ids.flatten(), fp8)


def sorted_tile_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    add: torch.Tensor | None = None,
    fp8: Fp8Scales | None = None,
    block_m: int | None = None,
    w8a8: bool = False,
    fuse_gate: bool = True,
    tiles: tuple[GemmTile, ...] | None = None,
) -> torch.Tensor:
    """dispatch.fused_experts' contract over pairs sorted by expert into tiles of block_m rows (sorted_tile_rows'
    where None). w8a8: block-FP8 experts with fp8 activations, what moe.experts_reference computes with
    quantize_activations=True. fuse_gate False: the gate and up rows as one GEMM whose [pairs, 2I] output a
    separate kernel gates (one accumulator per program instead of two). tiles: both GEMMs' ladder (sweeps)."""
    block_m = block_m or sorted_tile_rows(ids.numel(), w13.shape[0])
    sorted_ids, tile_expert = sort_by_expert(ids, w13.shape[0], block_m)
    return _experts(
        x, w13, w2, weights, ids, act, add, block_m, sorted_ids, tile_expert, fp8, w8a8, fuse_gate, tiles
    )


def w8a8_tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per W8A8 tile: sorted_tile_rows' up to 64. In the fp8_tiles section of the GPU suite 128-row tiles
    (two fp8 accumulators per program in the gated GEMM) took more than twice the time of 64-row ones on long
    prompts at V3's widths."""
    return min(64, sorted_tile_rows(num_pairs, num_experts))


def w8a8_tile_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    add: torch.Tensor | None = None,
    fp8: Fp8Scales | None = None,
    block_m: int | None = None,
    fuse_gate: bool | None = None,
    tiles: tuple[GemmTile, ...] | None = None,
) -> torch.Tensor:
    """Block-FP8 experts with fp8 activations (W8A8), for the tensor cores' fp8 rate once the GEMMs are
    compute-bound: sorted_tile_experts with w8a8, in w8a8_tile_rows' tiles unless block_m says, the gate and up
    GEMMs fused only in tiles under 64 rows unless fuse_gate says (at 64 rows one accumulator per program and a
    separate gating kernel were the faster pair, from 32 pairs per expert up)."""
    block_m = block_m or w8a8_tile_rows(ids.numel(), w13.shape[0])
    fuse_gate = block_m < 64 if fuse_gate is None else fuse_gate
    return sorted_tile_experts(x, w13, w2, weights, ids, act, add, fp8, block_m, True, fuse_gate, tiles)
