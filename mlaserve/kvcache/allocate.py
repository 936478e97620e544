"""Sizing the paged cache from a memory budget and allocating one tensor per layer."""

import torch

from mlaserve.kvcache.quant import row_width
from mlaserve.kvcache.spec import KVCacheSpec, LayerCacheSpec


def num_blocks_for_budget(spec: KVCacheSpec, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    """Blocks that fit in budget_bytes (the caller adds the reserved null block)."""
    per_block = spec.bytes_per_token(dtype) * block_size
    return budget_bytes // per_block


def allocate_layer(layer: LayerCacheSpec, num_blocks: int, block_size: int, dtype, device):
    """One tensor per layer: the latent rows, or K and V stacked; (K, V) when their head sizes differ; (latent
    rows, indexer keys) with an indexer."""
    shape = (num_blocks, block_size, layer.num_kv_heads, row_width(layer.head_dim, dtype))
    if not layer.separate_value:
        latent = torch.zeros(shape, dtype=dtype, device=device)
        if not layer.index_head_dim:
            return latent
        index_shape = (num_blocks, block_size, 1, row_width(layer.index_head_dim, dtype))
        return latent, torch.zeros(index_shape, dtype=dtype, device=device)
    if layer.value_dim in (None, layer.head_dim):
        return torch.zeros((2, *shape), dtype=dtype, device=device)
    v_shape = (*shape[:3], layer.value_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(v_shape, dtype=dtype, device=device)


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    return [allocate_layer(layer, num_blocks, block_size, dtype, device) for layer in spec.layers]
