"""What the scheduler refuses at admission: a request it could never run, with a message naming the field."""

from __future__ import annotations

from mlaserve.core.kv_cache_manager import KVCacheManager
from mlaserve.core.request import Request


def validate_new_request(
    request: Request, requests: dict[str, Request], max_model_len: int, kv_cache_manager: KVCacheManager
) -> None:
    """requests: the scheduler's unfinished requests by id."""
    rid = request.request_id
    if rid in requests:
        raise ValueError(f"request_id {rid!r} is already in the scheduler")
    if request.num_tokens == 0:
        raise ValueError(f"request {rid!r}: prompt_token_ids must not be empty")
    if request.max_tokens < 1:
        raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
    max_len = max_model_len
    if request.num_tokens > max_len:
        raise ValueError(
            f"request {rid!r}: {request.num_tokens} prompt tokens exceed max_model_len ({max_len})"
        )
    # A request that cannot fit even alone would be preempted and retried forever. The last sampled
    # token never gets KV, unless the prompt alone already fills max_model_len.
    longest = min(request.num_prompt_tokens + request.max_tokens, max_len)
    num_kv_tokens = max(request.num_tokens, longest - 1)
    needed = kv_cache_manager.max_blocks_per_request(num_kv_tokens)
    if needed > kv_cache_manager.num_total_blocks:
        raise ValueError(
            f"request {rid!r}: up to {num_kv_tokens} tokens of KV need {needed} blocks, but the cache has only "
            f"{kv_cache_manager.num_total_blocks}; lower max_tokens/max_model_len or add KV blocks"
        )
