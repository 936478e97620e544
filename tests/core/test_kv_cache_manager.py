import pytest

from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from mlaserve.core.request import Request


def manager(num_blocks: int = 16, block_size: int = 4, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager([CacheGroupSpec(group_id=0, block_size=block_size)], num_blocks, enable_caching)


def req(rid: str, tokens: list[int], arrival: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, max_tokens=16, arrival_index=arrival)


def schedule_prefill(kv: KVCacheManager, request: Request) -> list[list[int]] | None:
    """What the scheduler does for a new request: look up hits, allocate the rest, mark hits computed."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if block_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return block_ids


def test_prefill_allocates_and_caches_full_blocks() -> None:
    kv = manager()
    a = req("a", list(range(10)))
    hits, n = kv.get_computed_blocks(a)
    assert hits == [[]] and n == 0
    assert kv.allocate_slots(a, 10) == [[1, 2, 3]]
    blocks = kv.managers[0].req_to_blocks["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 12 and kv.num_total_blocks == 15


def test_shared_prefix_shares_blocks() -> None:
    kv = manager()
    a, b = req("a", list(range(10))), req("b", list(range(8)) + [50, 51, 52])
    assert schedule_prefill(kv, a) == [[1, 2, 3]]
    hits, n = kv.get_computed_blocks(b)
    assert [[blk.block_id for blk in hits[0]]] == [[1, 2]] and n == 8
    assert kv.allocate_slots(b, 3, hits) == [[1, 2, 4]]
    pool_blocks = kv.block_pool.blocks
    assert [pool_blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool_blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.get_block_ids("a") == [[]]


def test_hit_is_capped_below_num_tokens() -> None:
    kv = manager()
    assert schedule_prefill(kv, req("a", list(range(8)))) == [[1, 2]]
    # Same 8 tokens: the last token must be recomputed, so only the first block (4 tokens) is a hit.
    _, n = kv.get_computed_blocks(req("b", list(range(8))))
    assert n == 4
    # 9 tokens: 8 may be computed, both blocks hit.
    hits, n = kv.get_computed_blocks(req("c", list(range(9))))
    assert n == 8 and [blk.block_id for blk in hits[0]] == [1, 2]
    # Fewer than block_size + 1 tokens: no hit possible.
    assert kv.get_computed_blocks(req("d", list(range(4))))[1] == 0


def test_freed_blocks_hit_again_with_exact_ids() -> None:
    kv = manager()
    a = req("a", list(range(12)))
    assert schedule_prefill(kv, a) == [[1, 2, 3]]
    kv.free(a)
    assert kv.num_used_blocks == 0
    b = req("b", list(range(12)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    assert kv.allocate_slots(b, 1, hits) == [[1, 2, 3, 4]]
    assert kv.num_free_blocks == 11


def test_tail_blocks_evicted_before_prefix_blocks() -> None:
    kv = manager(num_blocks=6)  # usable 1..5
    a = req("a", list(range(12)))
    assert schedule_prefill(kv, a) == [[1, 2, 3]]
    kv.free(a)  # free queue: 4, 5, 3, 2, 1
    other = req("x", list(range(500, 512)))
    assert schedule_prefill(kv, other) == [[4, 5, 3]]  # never-used blocks first, then a's tail block
    hits, n = kv.get_computed_blocks(req("b", list(range(13))))
    assert n == 8 and [blk.block_id for blk in hits[0]] == [1, 2]
    kv.free(other)  # queue: 2, 1, 3, 5, 4 (other's tail first)
    third = req("y", list(range(700, 716)))
    assert schedule_prefill(kv, third) == [[2, 1, 3, 5]]
    assert kv.get_computed_blocks(req("c", list(range(13))))[1] == 0


def test_allocation_failure_changes_nothing() -> None:
    kv = manager(num_blocks=6)
    a = req("a", list(range(8)))
    assert schedule_prefill(kv, a) == [[1, 2]]
    kv.free(a)  # queue: 3, 4, 5, 2, 1 -- blocks 1, 2 free but cached
    holder = req("h", list(range(300, 312)))
    assert schedule_prefill(kv, holder) == [[3, 4, 5]]
    # c hits 1, 2 and needs one more block: touching 1 and 2 empties the free queue, so it cannot fit.
    c = req("c", list(range(12)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.allocate_slots(c, 4, hits) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("c") == [[]]
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in hits[0])
    kv.free(holder)
    assert kv.allocate_slots(c, 4, hits) == [[1, 2, 5]]


def test_decode_growth_caches_output_blocks() -> None:
    kv = manager()
    a = req("a", [1, 2, 3, 4, 5])
    assert schedule_prefill(kv, a) == [[1, 2]]
    for token in (6, 7, 8):
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) == [[1, 2]]
        a.num_computed_tokens += 1
    a.append_output_token(9)
    assert kv.allocate_slots(a, 1) == [[1, 2, 3]]
    # Tokens 1..8 now fill two blocks, including generated ones, so a follow-up turn hits both.
    _, n = kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6, 7, 8, 100]))
    assert n == 8


def test_two_groups_share_the_pool() -> None:
    groups = [CacheGroupSpec(group_id=0, block_size=4), CacheGroupSpec(group_id=1, block_size=4)]
    kv = KVCacheManager(groups, num_blocks=16, enable_caching=True)
    assert schedule_prefill(kv, req("a", list(range(10)))) == [[1, 2, 3], [4, 5, 6]]
    hits, n = kv.get_computed_blocks(req("b", list(range(10))))
    assert n == 8 and [[blk.block_id for blk in g] for g in hits] == [[1, 2], [4, 5]]
    # The same tokens hash differently per group: no block is shared across groups.
    assert kv.block_pool.blocks[1].block_hash != kv.block_pool.blocks[4].block_hash


def test_groups_must_agree_on_the_hit() -> None:
    groups = [CacheGroupSpec(group_id=0, block_size=4), CacheGroupSpec(group_id=1, block_size=8)]
    kv = KVCacheManager(groups, num_blocks=32, enable_caching=True)
    a = req("a", list(range(24)))
    assert schedule_prefill(kv, a) == [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    assert kv.get_computed_blocks(req("b", list(range(25))))[1] == 24
    # A 20-token hit would end mid-block for the 8-token group: rounded down to 16.
    hits, n = kv.get_computed_blocks(req("c", list(range(20)) + [77, 78]))
    assert n == 16 and [len(g) for g in hits] == [4, 2]
    kv.free(a)
    # Evict group 1's second block (block 8): the hit shrinks to 8 tokens for both groups.
    kv.block_pool._evict(kv.block_pool.blocks[8])
    hits, n = kv.get_computed_blocks(req("d", list(range(25))))
    assert n == 8 and [[blk.block_id for blk in g] for g in hits] == [[1, 2], [7]]


def test_prefix_cache_stats_and_reset() -> None:
    kv = manager(num_blocks=6)  # usable 1..5
    a = req("a", list(range(10)))
    schedule_prefill(kv, a)
    assert kv.prefix_cache_stats() == {"queries": 10, "hits": 0}
    # b does not fit yet: its repeated lookups count only once, when it is finally admitted.
    b = req("b", list(range(10)) + list(range(100, 110)))
    for _ in range(3):
        hits, n = kv.get_computed_blocks(b)
        assert n == 8 and kv.allocate_slots(b, 12, hits) is None
    assert kv.prefix_cache_stats() == {"queries": 10, "hits": 0}
    kv.free(a)
    assert schedule_prefill(kv, b) == [[1, 2, 4, 5, 3]]
    assert kv.prefix_cache_stats() == {"queries": 30, "hits": 8}
    assert kv.reset_prefix_cache() is False
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("c", list(range(10))))[1] == 0


def test_caching_disabled() -> None:
    kv = manager(enable_caching=False)
    schedule_prefill(kv, req("a", list(range(10))))
    assert kv.get_computed_blocks(req("b", list(range(10)))) == ([[]], 0)
    assert kv.prefix_cache_stats() == {"queries": 0, "hits": 0}


def test_invalid_specs() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        CacheGroupSpec(group_id=0, kind="nonsense")
    with pytest.raises(ValueError, match="block_size"):
        CacheGroupSpec(group_id=0, block_size=0)
    with pytest.raises(ValueError, match="unique"):
        KVCacheManager([CacheGroupSpec(0), CacheGroupSpec(0)], 8, True)
    with pytest.raises(ValueError, match="at least one"):
        KVCacheManager([], 8, True)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager().allocate_slots(req("a", [1]), 0)


def test_prefix_hits_only_start_a_table() -> None:
    kv = manager()
    schedule_prefill(kv, req("a", list(range(10))))
    b = req("b", list(range(10)))
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 2) == [[4]]
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots(b, 2, hits)
    assert [blk.ref_cnt for blk in hits[0]] == [1, 1]  # nothing touched
