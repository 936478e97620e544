"""Per-head matmuls of absorbed MLA decode (q_nope by W_UK, the attended latent by W_UV) on the grouped GEMM.

Each head has its own small matrix, which is a mixture of experts with one expert per head and every token
routed to all of them: fused_moe's grouped GEMM with one (token, head) pair per tile does it in one launch,
streaming each head's matrix at HBM speed. cuBLAS's batched GEMM took 5.7 and 3.2 us per layer for V2-Lite at one
token (benchmarks/h200_diagnose.py, host section). `torch.einsum` in mla.py is the reference and the CPU path.
"""

import torch

from mlaserve.layers.fused_moe import grouped_gemm

MAX_TOKENS = 16  # decode-sized batches; larger ones keep cuBLAS, whose tiles then share each head's matrix


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, head_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (any strides with unit last stride and rows of one token H * row stride apart), w [H, N, K]
    (any strides), head_ids [>= T * H] int32 with head_ids[i] = i % H -> [T, H, N] in x's dtype."""
    tokens, heads, k = x.shape
    if w.shape[0] != heads or w.shape[2] != k or x.stride(-1) != 1 or x.stride(0) != heads * x.stride(1):
        raise ValueError(f"per_head_matmul: x {tuple(x.shape)} {x.stride()} with w {tuple(w.shape)}")
    pairs = tokens * heads
    rows = x.as_strided((pairs, k), (x.stride(1), 1))
    out = grouped_gemm(rows, w, None, head_ids[:pairs], pairs, 1, None, 16)
    return out.view(tokens, heads, w.shape[1])
