"""GQA/MHA attention written exactly as MLA (`enable_mla=True` with no rank: the exact conversion, TransMLA's first
step), served from the paged latent cache by the MLA code path.

Each token caches one row [V of every KV head | rotated K of every KV head]: the "latent" is the values (the value
up-projection of head h selects its KV group's slice) and the decoupled rope key is every KV head's rotated key side
by side (head h's rope query is its rotated query in its group's slice, zero elsewhere). No key part goes through
the latent (W_UK = 0). Scores and outputs are GQA's exactly, and the row is as wide as GQA's K plus V, so the cache
costs what it did; what changes is the layout, which the MLA kernels read (and 8-bit latent caches quantize), and
which a low-rank conversion then compresses.

Absorbed decode reads the rows in place (backend.decode_latent); prefill expands them back to per-head K/V and runs
the backend's GQA prefill.
"""

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend, write_to_cache
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.kvcache.quant import is_quantized, quantize_rows


class LatentGQA(nn.Module):
    def __init__(
        self, backend: AttentionBackend, scale: float, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        super().__init__()
        self.backend, self.scale = backend, scale
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.latent_dim = self.rope_dim = num_kv_heads * head_dim
        self.cache_group = 0  # set by the engine (CausalLM.set_cache_groups)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (rotated); kv_cache [blocks, page, 1, Hkv * 2D]. Returns [T, H, D]."""
        meta = meta.for_group(self.cache_group)
        rows = torch.cat((v.flatten(1), k.flatten(1)), dim=-1).unsqueeze(1)
        write_to_cache(
            kv_cache,
            meta.slot_mapping,
            quantize_rows(rows, kv_cache.dtype) if is_quantized(kv_cache.dtype) else rows,
        )
        nd, parts = meta.num_decodes, []
        if nd:
            parts.append(self._decode(q[:nd], kv_cache, meta))
        if nd < meta.num_seqs:
            parts.append(self._prefill(q[nd:], kv_cache, meta))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] as [T, Hkv, H / Hkv, ...]: the query heads of each KV head."""
        return x.view(x.shape[0], self.num_kv_heads, self.num_heads // self.num_kv_heads, *x.shape[2:])

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        kv = torch.arange(hkv, device=q.device)
        # head h's rope query: its rotated query in its KV group's slice of the rope key, zero in the others
        q_pe = q.new_zeros(t, hkv, self.num_heads // hkv, hkv, d)
        q_pe[:, kv, :, kv] = self._groups(q).transpose(0, 1)
        q_latent = q.new_zeros(t, self.num_heads, self.latent_dim)
        out = self.backend.decode_latent(
            q_latent, q_pe.view(t, self.num_heads, self.rope_dim), kv_cache, meta, self.scale, self.latent_dim
        )
        # the value up-projection: each head's own KV group's slice of the attended values
        values = self._groups(out).view(t, hkv, -1, hkv, d)[:, kv, :, kv]  # [Hkv, T, H / Hkv, D]
        return values.transpose(0, 1).reshape(t, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        context = self.backend.gather_prefill_context(kv_cache, meta, q.dtype)[:, 0]  # [S, latent + rope]
        v, k = context.split([self.latent_dim, self.rope_dim], dim=-1)
        shape = (context.shape[0], self.num_kv_heads, self.head_dim)
        return self.backend.prefill(q, k.reshape(shape), v.reshape(shape), meta, self.scale)
