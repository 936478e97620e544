"""Training-free block-sparse attention for any model with per-head K/V caches (the engine's `index_topk` option).

Each query attends to a few whole cache blocks: the sequence's first block (attention sinks), its own block and the
one before it (the local window), and the `topk` other blocks that score best against it. A block's score is the
query's dot product with the block's mean key, per KV head the maximum over the query heads that read that head
(Quest's idea with a mean instead of min/max summaries; DeepSeek-V3.2's indexer learns the scores instead). Nothing
is freed, so memory is the exact model's; the attention reads topk + 3 blocks per query instead of all of them.

This is the torch reference: per sequence, the whole context gathered and masked. It is lossy by design;
benchmarks/quality.py measures what it costs.
"""

import torch
import torch.nn.functional as F

from mlaserve.attention.metadata import AttentionMetadata, slot_indices


def block_mask(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int
) -> torch.Tensor:
    """[Hkv, q_len, n] True where a query may read a key. q [q_len, H, D] at positions q_pos, k [n, Hkv, D] at
    positions 0..n-1."""
    n, hkv = k.shape[0], k.shape[1]
    blocks = -(-n // block_size)
    pad = blocks * block_size - n
    padded = torch.cat((k.float(), k.new_zeros(pad, *k.shape[1:]).float()))
    counts = torch.full((blocks,), float(block_size), device=k.device)
    counts[-1] = block_size - pad
    summary = padded.view(blocks, block_size, hkv, -1).sum(1) / counts[:, None, None]  # [blocks, Hkv, D]
    qg = q.float().view(q.shape[0], hkv, -1, q.shape[-1])
    scores = torch.einsum("qhgd,bhd->hqgb", qg, summary).amax(dim=2)  # [Hkv, q_len, blocks]
    own = (q_pos // block_size)[None, :, None]
    block_ids = torch.arange(blocks, device=k.device)[None, None, :]
    fixed = (block_ids == 0) | ((block_ids <= own) & (block_ids >= own - 1))
    candidate = (block_ids < own - 1) & (block_ids > 0)
    scores = scores.masked_fill(~candidate, float("-inf"))
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=k.device)
    if topk and blocks:
        best = scores.topk(min(topk, blocks), dim=-1)
        chosen.scatter_(-1, best.indices, best.values > float("-inf"))
    visible_blocks = fixed | chosen  # [Hkv, q_len, blocks]
    key_pos = torch.arange(n, device=k.device)
    causal = key_pos[None, :] <= q_pos[:, None]
    return visible_blocks[..., key_pos // block_size] & causal[None]


def block_topk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    topk: int,
) -> torch.Tensor:
    """Every sequence's queries ([T, H, D], this step's K/V already cached) over its block selection."""
    out, start = [], 0
    for i, (q_len, n) in enumerate(zip(meta.query_lens, meta.host_seq_lens, strict=True)):
        slots = slot_indices(meta.block_tables[i], n, meta.block_size)
        k = k_cache.flatten(0, 1)[slots]  # [n, Hkv, D]
        v = v_cache.flatten(0, 1)[slots]
        qi = q[start : start + q_len]
        mask = block_mask(qi, k, torch.arange(n - q_len, n, device=q.device), meta.block_size, topk)
        groups = qi.shape[1] // k.shape[1]
        # Fused by SDPA (each query sees at least its own key); the mask is per KV head, so per query head repeated.
        attended = F.scaled_dot_product_attention(
            qi.float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=mask.repeat_interleave(groups, 0),
            scale=scale,
            enable_gqa=True,
        )
        out.append(attended.transpose(0, 1).to(q.dtype))
        start += q_len
    return torch.cat(out)
