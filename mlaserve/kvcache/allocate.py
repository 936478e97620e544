"""Sizing the paged cache from a memory budget and allocating it: one tensor per layer from one shared pool, or,
with a pool per group (DeepSeek-V4), each layer's rows and its compressed entries in tensors of their own groups'
blocks."""

import torch

from mlaserve.kvcache.quant import row_width
from mlaserve.kvcache.spec import KVCacheSpec, LayerCacheSpec


def num_blocks_for_budget(spec: KVCacheSpec, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    """Blocks that fit in budget_bytes (the caller adds the reserved null block)."""
    per_block = spec.bytes_per_token(dtype) * block_size
    return budget_bytes // per_block


def group_blocks_for_budget(
    spec: KVCacheSpec, dtype: torch.dtype, block_size: int, budget_bytes: int, own_blocks: int
) -> list[int]:
    """Blocks of each group's pool (null blocks left out) with a pool per group: each of the layers' own groups
    (windows) gets own_blocks, what the running requests' windows can hold at once, within half the budget; the
    entry groups share the rest so that each holds the same number of tokens, the rate at which a long sequence
    fills them."""
    sizes = spec.group_slot_bytes(dtype)
    first = len(sizes) - len(spec.entry_rules)
    own_bytes = sum(sizes[:first]) * block_size
    own = max(min(own_blocks, budget_bytes // 2 // own_bytes), 1)
    tokens = (budget_bytes - own * own_bytes) / spec.context_bytes_per_token(dtype)
    return [own] * first + [max(int(tokens // (block_size * rule.ratio)), 1) for rule in spec.entry_rules]


def allocate_layer(layer: LayerCacheSpec, num_blocks: int, block_size: int, dtype, device):
    """One tensor per layer: the latent rows, or K and V stacked; (K, V) when their head sizes differ; (latent
    rows, indexer keys) with an indexer."""
    shape = (num_blocks, block_size, layer.num_kv_heads, layer.row_elements(dtype))
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


def allocate_group_caches(
    spec: KVCacheSpec, group_blocks: list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> list:
    """A pool per group (group_blocks: each pool's blocks, null block included): a layer's rows in its own group's
    blocks and, for a layer with compressed entries, (rows, entries) with the entries in its entry group's blocks,
    each entry only as wide as the layer's."""
    out = []
    for layer, group in zip(spec.layers, spec.layer_groups(), strict=True):
        rows = allocate_layer(layer, group_blocks[group], block_size, dtype, device)
        entry_group = spec.entry_group(layer)
        if entry_group is None:
            out.append(rows)
            continue
        shape = (group_blocks[entry_group], block_size, 1, layer.entry_elements(dtype))
        out.append((rows, torch.zeros(shape, dtype=dtype, device=device)))
    return out
