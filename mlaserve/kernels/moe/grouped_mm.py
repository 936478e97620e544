"""The experts of a long prompt through torch's grouped GEMM (torch._grouped_mm: CUTLASS, TMA and warp-specialized
on sm_90), which beats the tiled Triton GEMMs once every expert has a few hundred pairs (dispatch.py says when).

Pairs are sorted by expert (no padding), their tokens gathered into one contiguous [pairs, hidden] block, one grouped
GEMM per projection runs over the experts' row ranges, and the combine reads each pair's row back through the sort.
No host sync: the offsets stay on the device. bf16 only, in whole 16-byte rows (CUTLASS's alignment).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mlaserve.kernels.moe.combine import combine
from mlaserve.kernels.moe.gated import act_and_mul, silu_and_mul


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """dispatch.fused_experts' contract (x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], weights and ids
    [T, top_k], plus `add` [T, hidden] summed in) through torch._grouped_mm."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    gate_up = torch._grouped_mm(x.index_select(0, order // top_k), w13.transpose(1, 2), offs=offs)
    hidden = silu_and_mul(gate_up) if act is F.silu else act_and_mul(gate_up, act)
    down = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)
    return combine(down, top_k, add, pos, weights.flatten().float().contiguous())
