"""The decode table's last entry: absorbed MLA decode in plain torch, straight from block tables.

It takes every shape on any device, so every call has a kernel; the dispatcher picks it only where Triton cannot
run (or no kernel takes the shape). It reads every row a table names and masks those past each sequence's length,
so its shapes are fixed and nothing waits on the host: it can be captured in a CUDA graph.
"""

import torch

from mlaserve.kernels.mla_decode.rules import DecodePlan
from mlaserve.kvcache.quant import dequantize_rows, is_quantized


def paged_latent_decode(
    q: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, R], q_pe [B, H, P], cache [blocks, page, 1, R + P] (8-bit rows too) -> (out [B, H, R] in q's
    dtype, lse [B, H] float32); with a window, each sequence's last `window` rows only."""
    page = cache.shape[1]
    pos = torch.arange(block_table.shape[1] * page, device=q.device)
    slots = block_table.long()[:, pos // page] * page + pos % page  # [B, L]
    rows = cache.flatten(0, 2).index_select(0, slots.reshape(-1)).view(*slots.shape, cache.shape[-1])
    k = dequantize_rows(rows, torch.float32) if is_quantized(cache.dtype) else rows.float()  # [B, L, R + P]
    scores = torch.einsum("bhd,bld->bhl", torch.cat((q, q_pe), -1).float(), k) * scale
    hidden = pos[None, :] >= seq_lens[:, None]
    if window:
        hidden |= pos[None, :] < seq_lens[:, None] - window
    scores.masked_fill_(hidden[:, None, :], float("-inf"))
    k = k.masked_fill(hidden[..., None], 0.0)  # a freed block before a window may hold anything, NaN included
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhl,bld->bhd", torch.exp(scores - lse[..., None]), k[..., :kv_lora_rank])
    return out.to(q.dtype), lse


def launch(
    plan: DecodePlan,
    q: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table entry's launch: the plan has nothing to tune."""
    return paged_latent_decode(q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale, plan.window)
