"""DeepSeek-V3.2's lightning indexer: a small multi-head scorer that picks the cached tokens each query attends to.

Each token caches one indexer key (index_head_dim values, LayerNorm'd, the first qk_rope_head_dim rotated NeoX
style) in the same blocks as its latent row, so the key lives and dies with the row it indexes: prefix-cache hits,
chunked prefill and preemption need nothing of their own. Queries come from the attention's low-rank query
(q_resid) through wq_b; per-head weights come from the hidden state through weights_proj, which stays float32 as
in the reference checkpoint's loading rules.
"""

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend, write_to_cache
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.config.model_config import IndexerConfig
from mlaserve.config.quantization import BlockFP8Config
from mlaserve.kvcache.quant import is_quantized, quantize_rows
from mlaserve.layers.linear import ReplicatedLinear
from mlaserve.layers.rotary import RotaryEmbedding, rope_frequencies
from mlaserve.parallel import ParallelContext


class Indexer(nn.Module):
    def __init__(
        self,
        cfg: object,
        index: IndexerConfig,
        backend: AttentionBackend,
        ctx: ParallelContext,
        quant: BlockFP8Config | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.topk, self.num_heads, self.head_dim = index.topk, index.num_heads, index.head_dim
        # Every rank scores all heads (the indexer is small next to attention), so each picks the same tokens.
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, index.num_heads * index.head_dim, False, ctx, quant)
        self.wk = ReplicatedLinear(cfg.hidden_size, index.head_dim, False, ctx, quant)
        self.k_norm = nn.LayerNorm(index.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, index.num_heads, bias=False, dtype=torch.float32)
        self.rotary = RotaryEmbedding(*rope_frequencies(cfg, index.rope_dim), interleaved=False)
        self.scale = index.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        key_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Caches this step's indexer keys and returns each query's selected slots ([T, k], -1 padded), or None
        when no sequence's context exceeds top-k: every query then sees all it may, and dense attention is exact."""
        num_tokens = hidden.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)
        q, k = self.rotary(positions, q, k)
        write_to_cache(
            key_cache,
            meta.slot_mapping,
            quantize_rows(k, key_cache.dtype) if is_quantized(key_cache.dtype) else k,
        )
        if max(meta.host_seq_lens) <= self.topk:
            return None
        weights = self.weights_proj(hidden.float()) * self.num_heads**-0.5
        return self.backend.select_topk(q, weights, key_cache, meta, positions, self.topk, self.scale)
