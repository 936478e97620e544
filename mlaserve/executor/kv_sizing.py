"""How many KV blocks the engine gets: from an explicit count, a byte budget, or the GPU's free memory."""

import logging

import torch

from mlaserve.config.engine_config import CacheOptions
from mlaserve.kvcache.allocate import group_blocks_for_budget, num_blocks_for_budget
from mlaserve.kvcache.spec import KVCacheSpec

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_budget_bytes(config: CacheOptions, device: torch.device) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(int(total * config.gpu_memory_utilization) - used, 0)
    return CPU_DEFAULT_KV_BYTES


def num_kv_blocks(config: CacheOptions, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device) -> int:
    """Usable blocks plus the reserved null block."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + 1
    return num_blocks_for_budget(spec, dtype, config.block_size, kv_budget_bytes(config, device)) + 1


def group_kv_blocks(
    config: CacheOptions, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, own_blocks: int
) -> list[int]:
    """With a pool per group: each pool's usable blocks plus its null block. num_kv_blocks sizes every pool alike."""
    if config.num_kv_blocks is not None:
        return [config.num_kv_blocks + 1] * len(spec.group_rules())
    budget = kv_budget_bytes(config, device)
    return [n + 1 for n in group_blocks_for_budget(spec, dtype, config.block_size, budget, own_blocks)]
