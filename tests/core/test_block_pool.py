import pytest

from mlaserve.core.block_hash import hash_block_tokens, update_block_hashes
from mlaserve.core.block_pool import BlockPool
from mlaserve.core.request import Request


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    # The null block is skipped by touch/free: its ref count is not tracked.
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0


def test_pool_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_allocate_free_ref_counts() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=False)
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    pool.touch(a[:2])
    assert [b.ref_cnt for b in a] == [2, 2, 1]
    pool.free_blocks(a)
    assert [b.ref_cnt for b in a] == [1, 1, 0]
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 5
    pool.free_blocks(a[:2])
    assert pool.num_used_blocks == 0 and pool.usage == 0.0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(a[:1])


def test_freed_block_stays_cached_until_evicted() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, h)
    pool.free_blocks([block])
    assert block.block_hash == h and pool.get_cached_block(h) is block
    # Touching a free cached block pulls it out of the free queue without evicting it.
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    # Allocation takes 2 and 3 first (never used); block 1 is evicted only when it is the last one left.
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert pool.get_cached_block(h) is block
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_lru_eviction_order() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True)
    blocks = pool.get_new_blocks(6)
    hashes = [hash_block_tokens(None, [i]) for i in range(6)]
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache_full_block(b, h)
    # Free in the order 4, 2, 6, 1, 3, 5: eviction must follow exactly that order.
    order = [4, 2, 6, 1, 3, 5]
    pool.free_blocks([blocks[i - 1] for i in order])
    evicted = []
    for _ in range(6):
        (b,) = pool.get_new_blocks(1)
        evicted.append(b.block_id)
        still_cached = {
            blk.block_id for blk, h in zip(blocks, hashes, strict=True) if pool.get_cached_block(h) is blk
        }
        assert still_cached == set(order[len(evicted) :])
    assert evicted == order


def test_duplicate_hash_keeps_first_owner() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5, 6])
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(block, h)
    assert block.block_hash is None and pool.get_cached_block(h) is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(block, h)
    assert pool.reset_prefix_cache() is False  # refused while a block is in use
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_hash_is_chained_and_group_scoped() -> None:
    tokens = [1, 2, 3, 4]
    root = hash_block_tokens(None, tokens)
    assert isinstance(root, bytes) and len(root) == 16
    assert hash_block_tokens(None, tokens) == root  # deterministic
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(root, tokens) != hash_block_tokens(other_parent, tokens)
    assert hash_block_tokens(None, tokens, group_id=1) != root
    assert hash_block_tokens(None, [1, 2, 3]) != hash_block_tokens(None, [1, 2, 3, 0])
    assert hash_block_tokens(None, [2**40, -1]) != hash_block_tokens(None, [0, -1])


def test_update_block_hashes_grows_lazily() -> None:
    req = Request(request_id="a", prompt_token_ids=list(range(10)), max_tokens=8, arrival_index=0)
    hashes = update_block_hashes(req, block_size=4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    req.append_output_token(10)
    assert len(update_block_hashes(req, block_size=4)) == 2
    req.append_output_token(11)
    again = update_block_hashes(req, block_size=4)
    assert again is hashes and len(hashes) == 3
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])
    g1 = update_block_hashes(req, block_size=4, group_id=1)
    assert len(g1) == 3 and set(g1).isdisjoint(hashes)
    assert set(req.block_hashes) == {0, 1}
