"""What each layer caches per token, and how many bytes that costs."""

from dataclasses import dataclass

import torch

from mlaserve.kvcache.quant import row_width


@dataclass(frozen=True)
class LayerCacheSpec:
    num_kv_heads: int  # 1 for the MLA latent
    head_dim: int  # kv_lora_rank + qk_rope_head_dim for MLA
    separate_value: bool  # GQA caches K and V; MLA reads its value out of the latent row
    value_dim: int | None = None  # V's head size when it differs from K's (MLA with mla_disable: 192 vs 128)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        if not self.separate_value:
            return self.num_kv_heads * row_width(self.head_dim, dtype) * dtype.itemsize
        return self.num_kv_heads * (self.head_dim + (self.value_dim or self.head_dim)) * dtype.itemsize


@dataclass(frozen=True)
class KVCacheSpec:
    layers: tuple[LayerCacheSpec, ...]
    is_mla: bool
    # Elements per token per layer that per-head K/V would cache (MLA models only): heads x (qk_head + v_head).
    mha_elements_per_layer: int = 0

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(layer.bytes_per_token(dtype) for layer in self.layers)

    def mha_bytes_per_token(self, dtype: torch.dtype) -> int:
        return len(self.layers) * self.mha_elements_per_layer * dtype.itemsize
