"""The attention backend interface shared by MLA and GQA layers.

Caches are paged: [num_blocks, block_size, num_kv_heads, head_dim]. MLA stores one latent "head" per token
(kv_lora_rank + qk_rope_head_dim values) and reads its value as the first kv_lora_rank of them, so the same
decode call serves absorbed MLA (MQA over the latent) and GQA.
"""

from abc import ABC, abstractmethod

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.kvcache.quant import dequantize_rows, is_quantized


class AttentionBackend(ABC):
    name: str = ""
    # True when decode has no data-dependent shapes or host syncs for latent (MLA) caches: CUDA-graph safe.
    supports_cuda_graphs: bool = False
    # What decode runs, as the start-up log and stats() name it; a backend that picks by shape overrides
    # decode_kernel for latent caches.
    decode_kernel_name: str = ""
    # Whether decode runs the paged Triton kernels, which a model that attends itself then calls too (DeepSeek-V4).
    paged_kernels: bool = False

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """None if the backend can run on `device`, else why not."""
        return None

    def decode_kernel(
        self,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        cache_dtype: torch.dtype,
        block_size: int,
        device: torch.device,
        query_dtype: torch.dtype | None = None,
    ) -> str:
        """The kernel that runs absorbed MLA decode for this shape (heads per rank, latent and rotary widths, cache
        dtype, page size) on `device`; query_dtype defaults to the cache's (bfloat16 for 8-bit caches)."""
        return self.decode_kernel_name

    def graph_decode_plan(self, rows: int, max_pages: int) -> object | None:
        """A decode plan for a CUDA graph of `rows` padded rows whose tables hold up to max_pages pages each, kept by
        the runner and set as each capture's `AttentionMetadata.decode_plan`; None for backends that plan nothing.
        Once the capture has planned it (`planned`), the runner calls its `replan(seq_lens, tables)` with each step's
        host lengths and tables before the replay: host work that a graph cannot hold."""
        return None

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        need_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query token per decode sequence. q: [num_decodes, H, Dk]; v_cache None means the value is
        k_cache[..., :v_dim] (MLA latent). Returns (out [num_decodes, H, v_dim], lse [num_decodes, H]); a backend
        may return lse None unless need_lse (merging partial results needs it, a plain decode does not)."""

    def decode_latent(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_lora_rank: int,
    ) -> torch.Tensor:
        """Absorbed MLA decode with the query's latent and rope parts apart ([num_decodes, H, R] and [.., P]);
        returns [num_decodes, H, R]. Joined into one query for decode by default; a backend that reads the two
        parts in place overrides this and saves the concatenation."""
        q = torch.cat((q_latent, q_pe), dim=-1)
        return self.decode(q, cache, None, meta, scale, kv_lora_rank)[0]

    def sparse_kernels(
        self, num_heads: int, kv_lora_rank: int, rope_dim: int, cache_dtype: torch.dtype, device: torch.device,
        query_dtype: torch.dtype | None = None,
    ) -> str:  # fmt: skip
        """What runs DeepSeek-V3.2's selection and sparse attention for this shape, for the log and stats()."""
        return "torch reference"

    def select_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_cache: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        topk: int,
        scale: float,
    ) -> torch.Tensor:
        """DeepSeek-V3.2's selection: each query token's top-k cached tokens by index score, [T, k] flat slots, -1
        padded (attention/sparse.py). q [T, H, D] roped indexer queries, weights [T, H] float32; positions [T] are
        the tokens' absolute positions (a token sees keys 0..its position). The torch reference by default."""
        from mlaserve.attention.sparse import select_topk

        return select_topk(q, weights, key_cache, meta, topk, scale)

    def sparse_latent(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        kv_lora_rank: int,
    ) -> torch.Tensor:
        """Absorbed MLA of each query token over only its selected latent rows (slots [T, k], -1 padded after the
        valid ones) -> [T, H, R]. The torch reference by default."""
        from mlaserve.attention.sparse import sparse_latent_attention

        return sparse_latent_attention(q_latent, q_pe, cache, slots, scale, kv_lora_rank)

    @abstractmethod
    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
    ):
        """Causal attention for the prefill sequences. q: [prefill tokens, H, Dk]; k, v: every prefill
        sequence's whole context concatenated, [sum of seq_lens, Hkv, D]. Query j of a sequence sits at absolute
        position seq_len - query_len + j (bottom-right causal alignment). Returns [prefill tokens, H, Dv]."""

    def prefill_kernel(
        self,
        device: torch.device,
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        qk_dim: int,
        v_dim: int,
        sinks: int,
    ) -> str:
        """What prefill runs for this shape (heads per rank, K/V heads, query/key and value widths, attention
        sinks) on `device`, as the start-up log and stats() name it."""
        return "torch reference"

    def prefill_pads_values(
        self, q: torch.Tensor, kv_heads: int, v_dim: int, meta: AttentionMetadata
    ) -> bool:
        """Whether prefill wants V zero-padded to K's width (a kernel that takes one head size), so a caller that
        builds V anyway (MLA's expanded prefill, kernels/prefill_kv.py) writes it so and saves the copy."""
        return False

    def gather_prefill_context(
        self, cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Every prefill sequence's cached context (after this step's writes), [sum of seq_lens, Hkv, D];
        8-bit latent rows come back dequantized to `dtype`."""
        rows = cache.flatten(0, 1).index_select(0, meta.prefill_slot_index)
        return dequantize_rows(rows, dtype) if is_quantized(cache.dtype) else rows


def write_to_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store this step's KV rows ([num_tokens, Hkv, D]) at their slots."""
    values = values.to(cache.dtype)
    if cache.element_size() == 1:  # 8-bit rows: copy bytes (index_copy_ has no fp8 kernel on every device)
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values)
