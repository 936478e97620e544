"""Pure-Python engine core (no torch): requests, block pool, KV-cache manager, scheduler."""

from mlaserve.core.block_hash import BlockHash, hash_block_tokens, update_block_hashes
from mlaserve.core.block_pool import BlockPool, KVBlock
from mlaserve.core.kv_cache_manager import (
    CacheGroupSpec,
    FullAttentionManager,
    KVCacheManager,
    SingleTypeManager,
)
from mlaserve.core.request import Request, RequestStatus
from mlaserve.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "BlockHash",
    "BlockPool",
    "CacheGroupSpec",
    "FullAttentionManager",
    "KVBlock",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SingleTypeManager",
    "hash_block_tokens",
    "update_block_hashes",
]
