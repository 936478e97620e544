"""GQA/MHA attention over the paged K/V cache: writes this step's K/V, then decode and prefill via the backend."""

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend, write_to_cache
from mlaserve.attention.block_topk import block_topk_attention
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.pooled_window import (
    PooledWindow,
    paged_pooled_attention,
    pooled_window_attention,
    write_pooled_entries,
)


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale
        self.cache_group = (
            0  # set by the engine (CausalLM.set_cache_groups): whose block tables and window apply
        )
        self.block_topk: int | None = None  # the engine's training-free index_topk (attention/block_topk.py)
        # the engine's training-free compress_ratio (attention/pooled_window.py), its entries in this cache group
        self.pooled_window: PooledWindow | None = None
        self.pooled_group = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, blocks, block_size, Hkv, D]. Returns [T, H, D]."""
        groups = meta.groups
        meta = meta.for_group(self.cache_group)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_to_cache(k_cache, meta.slot_mapping, k)
        write_to_cache(v_cache, meta.slot_mapping, v)
        if self.block_topk:
            return block_topk_attention(q, k_cache, v_cache, meta, self.scale, self.block_topk)
        if self.pooled_window is not None:
            if groups is None:  # the runner's warm-up pass, with no block tables at all
                return pooled_window_attention(q, k_cache, v_cache, meta, self.scale, self.pooled_window)
            entries = groups[self.pooled_group]
            write_pooled_entries(k_cache, entries)
            write_pooled_entries(v_cache, entries)
            return paged_pooled_attention(q, k_cache, v_cache, meta, entries, self.scale, self.pooled_window)
        nd = meta.num_decodes
        parts = []
        if nd:
            parts.append(self.backend.decode(q[:nd], k_cache, v_cache, meta, self.scale, v.shape[-1])[0])
        if nd < meta.num_seqs:
            k_ctx = self.backend.gather_prefill_context(k_cache, meta)
            v_ctx = self.backend.gather_prefill_context(v_cache, meta)
            parts.append(self.backend.prefill(q[nd:], k_ctx, v_ctx, meta, self.scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
