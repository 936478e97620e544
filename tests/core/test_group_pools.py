"""A pool per cache group (KVCacheManager given a block count per group, as DeepSeek-V4's windows and compressed
entries are): each group's block ids are its own, a request is admitted only when every pool can serve it, and
prefix hits, freeing and the prefix-cache reset work per pool."""

import pytest

from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from tests.core.test_kv_cache_manager import req, schedule_prefill


def window_and_entries(
    window_blocks: int = 8, entry_blocks: int = 4, max_chunk_tokens: int | None = None
) -> KVCacheManager:
    """A window of 8 tokens in blocks of 4, and entries of rate 4 in blocks of 4 (16 tokens a block)."""
    groups = [
        CacheGroupSpec(group_id=0, kind="sliding_window", block_size=4, window=8),
        CacheGroupSpec(group_id=1, block_size=16),
    ]
    return KVCacheManager(groups, [window_blocks, entry_blocks], True, max_chunk_tokens)


def test_each_group_numbers_its_own_blocks() -> None:
    kv = window_and_entries()
    assert schedule_prefill(kv, req("a", list(range(20)))) == [[1, 2, 3, 4, 5], [1, 2]]
    assert kv.num_total_blocks == 7 + 3 and kv.num_used_blocks == 7
    assert kv.blocks_per_group() == [5, 2]


def test_a_request_waits_when_any_pool_is_short() -> None:
    kv = window_and_entries(window_blocks=16, entry_blocks=3)  # 2 usable entry blocks: 32 tokens
    assert schedule_prefill(kv, req("a", list(range(20)))) is not None
    b = req("b", list(range(100, 120)))
    assert schedule_prefill(kv, b) is None  # the window pool has room, the entries' pool has not
    assert kv.num_used_blocks == 5 + 2  # nothing taken for b
    kv.free(req("a", list(range(20))))
    assert schedule_prefill(kv, b) is not None


def test_windows_give_back_to_their_own_pool() -> None:
    kv = window_and_entries()
    a = req("a", list(range(20)))
    schedule_prefill(kv, a)
    kv.free_skipped(a)  # the next query reads tokens 13..20: blocks 0..2 leave the window
    assert kv.blocks_per_group() == [2, 2]
    assert kv.block_pool.num_free_blocks == 7 - 2 and kv.pools[1].num_free_blocks == 3 - 2


def test_prefix_hits_and_reset_per_pool() -> None:
    kv = window_and_entries(window_blocks=16, entry_blocks=8)
    a = req("a", list(range(40)))
    schedule_prefill(kv, a)
    hits, n = kv.get_computed_blocks(req("b", list(range(40)) + [7]))
    assert n == 32 and [len(g) for g in hits] == [8, 2]
    assert kv.reset_prefix_cache() is False  # a still holds blocks
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("c", list(range(40)) + [7]))[1] == 0


def test_shortfall_names_the_pool_that_cannot_hold_one_request() -> None:
    kv = window_and_entries(window_blocks=8, entry_blocks=3, max_chunk_tokens=8)
    assert kv.shortfall(32) == []  # the window: 7 + 8 tokens' blocks and one more, at most
    assert kv.shortfall(64) == [(4, 2)]


def test_a_count_per_group_is_required() -> None:
    with pytest.raises(ValueError, match="one count per cache group"):
        KVCacheManager([CacheGroupSpec(0)], [4, 4], True)
