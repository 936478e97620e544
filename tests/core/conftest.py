"""Shared helpers for the core tests: request and scheduler factories (no torch anywhere)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from mlaserve.core.request import Request
from mlaserve.core.scheduler import Scheduler, SchedulerConfig

MakeRequest = Callable[..., Request]


@pytest.fixture
def make_request() -> MakeRequest:
    """make_request(prompt, max_tokens=16, request_id=None, **fields): ids "r0", "r1", ... in arrival order."""
    counter = itertools.count()

    def factory(
        prompt: list[int] | int, max_tokens: int = 16, request_id: str | None = None, **fields
    ) -> Request:
        index = next(counter)
        # An int prompt means "that many distinct tokens", offset so two such prompts never share a prefix.
        prompt_ids = (
            list(range(1000 * (index + 1), 1000 * (index + 1) + prompt))
            if isinstance(prompt, int)
            else prompt
        )
        return Request(
            request_id=request_id if request_id is not None else f"r{index}",
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            arrival_index=index,
            **fields,
        )

    return factory


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_caching: bool = True,
    prefill_first: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        prefill_first=prefill_first,
    )
    kv = KVCacheManager([CacheGroupSpec(group_id=0, block_size=block_size)], num_blocks, enable_caching)
    return Scheduler(config, kv)


@pytest.fixture
def scheduler_factory() -> Callable[..., Scheduler]:
    return make_scheduler
