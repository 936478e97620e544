"""Fused MoE on the GPU: which path runs a call's routed experts, from an ordered table (kernel.py's shape).

- grouped_mm: torch's grouped GEMM over unpadded expert runs (grouped_mm.py), for long prompts in bf16: from
  GROUPED_MM_PAIRS_PER_EXPERT pairs per expert it beat the Triton GEMMs, which won below that.
- fp8_w8a8_tiles: block-FP8 experts from W8A8_PAIRS_PER_EXPERT pairs per expert: sorted tiles whose GEMMs take
  activations quantized per token group (tiled.w8a8_tile_experts), fp8 x fp8 on the tensor cores; below that the
  experts' weight bytes are the cost, and the W8A16 tiles that leave x as it is are nearly as fast and more exact.
- pair_tiles: one pair per tile, no sort (tiled.py), where a handful of pairs spread over many experts rarely
  share an expert (small decode batches).
- sorted_tiles: pairs sorted by expert into tiles of one expert each (tiled.py), for everything else.

Each entry's supports and pays take fused_experts' arguments (with block-FP8 scales gathered into one Fp8Scales
after `add`). moe.experts_reference (layers/) is the plain per-expert loop all of them are tested against; for
block-FP8 experts, on layers/block_fp8.dequantize's weights (and with quantize_activations for fp8_w8a8_tiles).
"""

import functools
from collections.abc import Callable

import torch

from mlaserve.kernels.kernel import Kernel, always, first
from mlaserve.kernels.moe.grouped_mm import grouped_mm_experts
from mlaserve.kernels.moe.tiled import (
    Fp8Scales,
    pair_tile_experts,
    sorted_tile_experts,
    sorted_tile_rows,
    w8a8_tile_experts,
)
from mlaserve.kernels.registry import expert_scales_problem

# From this many (token, expert) pairs per expert torch's grouped GEMM replaces the Triton one for long prompts; the
# two were even at about this count at V2-Lite's shape, torch's faster above and slower below it.
GROUPED_MM_PAIRS_PER_EXPERT = 256
# From this many pairs per expert block-FP8 experts run W8A8 (fp8_w8a8_tiles) instead of W8A16. The fp8_paths
# section of the GPU suite timed both at 1 to 4,096 tokens: W8A8 was faster at every size, by a few percent while
# experts hold a handful of rows (the weight's bytes are the cost either way) and clearly from about 16 rows each;
# below that the W8A16 tiles, which leave x as it is, keep the more exact result.
W8A8_PAIRS_PER_EXPERT: int | None = 16  # None: never


def _grouped_mm_supports(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *rest: object, **options: object
) -> str | None:
    """bf16, widths in whole 16-byte rows (CUTLASS's alignment), and torch's grouped GEMM on this device (CUDA from
    sm_90; the CPU's runs the tests)."""
    if not hasattr(torch, "_grouped_mm"):
        return "needs torch._grouped_mm"
    if any(isinstance(r, Fp8Scales) for r in rest):
        return "takes bf16 weights, not block FP8"
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16:
        return "takes bf16 only"
    if any(d % 8 for d in (*w13.shape[1:], w2.shape[2])):
        return "takes widths in whole 16-byte rows"
    if x.is_cuda and not _grouped_mm_device(x.device.index if x.device.index is not None else -1):
        return "needs CUDA from sm_90"
    return None


@functools.cache
def _grouped_mm_device(index: int) -> bool:
    """Whether CUDA device `index` (-1: the current one) has torch's grouped GEMM kernel: sm_90 and newer."""
    device = torch.cuda.current_device() if index < 0 else index
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _grouped_mm_pays(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *rest: object,
) -> bool:
    return ids.numel() >= GROUPED_MM_PAIRS_PER_EXPERT * w13.shape[0]


def _w8a8_supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *rest: object) -> str | None:
    if not any(isinstance(r, Fp8Scales) for r in rest):
        return "takes block-FP8 experts"
    return None


def _w8a8_pays(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *rest: object,
) -> bool:
    return W8A8_PAIRS_PER_EXPERT is not None and ids.numel() >= W8A8_PAIRS_PER_EXPERT * w13.shape[0]


def pair_tiles_pay(num_pairs: int, num_experts: int) -> bool:
    """Whether pairs rarely share an expert: no more than one pair per four experts."""
    return num_pairs * 4 <= num_experts


def _pair_tiles_pay(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *rest: object,
) -> bool:
    return pair_tiles_pay(ids.numel(), w13.shape[0])


def _anywhere(*args: object, **kwargs: object) -> str | None:
    """The tiled Triton GEMMs take every shape and dtype the layers give them."""
    return None


GROUPED_MM = Kernel("grouped_mm", _grouped_mm_supports, grouped_mm_experts, pays=_grouped_mm_pays)
W8A8_TILES = Kernel("fp8_w8a8_tiles", _w8a8_supports, w8a8_tile_experts, pays=_w8a8_pays)
PAIR_TILES = Kernel("pair_tiles", _anywhere, pair_tile_experts, pays=_pair_tiles_pay)
SORTED_TILES = Kernel("sorted_tiles", _anywhere, sorted_tile_experts, pays=always)
MOE_KERNELS: tuple[Kernel, ...] = (
    GROUPED_MM,
    W8A8_TILES,
    PAIR_TILES,
    SORTED_TILES,
)  # ordered: the first that fits and pays


def tile_plan(num_pairs: int, num_experts: int) -> tuple[int, bool]:
    """(rows per tile, pair tiles?) of the tiled paths for a batch of (token, expert) pairs."""
    if pair_tiles_pay(num_pairs, num_experts):
        return 16, True
    return sorted_tile_rows(num_pairs, num_experts), False


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    block_m: int | None = None,
    add: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_n: int = 128,
    kernel: str | None = None,
) -> torch.Tensor:
    """Same contract as moe.experts_reference: x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], weights and
    ids [T, top_k]; plus `add` ([T, hidden], e.g. the shared experts' output) added to the result in the same kernel.

    Block-FP8 experts: w13 and w2 float8_e4m3fn with float32 scales w13_scale [E, ceil(2I/group_n), ceil(hidden/128)]
    and w2_scale [E, ceil(hidden/group_n), ceil(I/128)] (layers/block_fp8.py's layout); x stays in its dtype.

    block_m forces W8A16 sorted tiles of that height (tests, sweeps); else kernel forces the table's entry of that
    name wherever it supports the call (benchmarks); with neither the table chooses."""
    problem = expert_scales_problem(w13, w2, w13_scale, w2_scale, group_n)
    if problem is not None:
        raise ValueError(f"fused_experts: {problem}")
    fp8 = Fp8Scales(w13_scale, w2_scale, group_n) if w13_scale is not None else None
    if block_m is not None:
        return sorted_tile_experts(x, w13, w2, weights, ids, act, add, fp8, block_m)
    args = (x, w13, w2, weights, ids, act, add) + ((fp8,) if fp8 is not None else ())
    if kernel is None:
        return first(MOE_KERNELS, *args).launch(*args)
    chosen = next((k for k in MOE_KERNELS if k.name == kernel), None)
    if chosen is None:
        raise ValueError(f"fused_experts: kernel {kernel!r}; the table has {[k.name for k in MOE_KERNELS]}")
    if (reason := chosen.supports(*args)) is not None:
        raise ValueError(f"fused_experts: {kernel} {reason}")
    return chosen.launch(*args)
