"""The sliding-window group: blocks leave the table (null block in their place) the step they leave the window,
prefix hits need only the window's blocks, and a request's live blocks stay flat however long it runs."""

import pytest

from mlaserve.core.kv_cache_manager import CacheGroupSpec, KVCacheManager
from mlaserve.core.request import Request


def window_manager(
    window: int = 8, block_size: int = 4, num_blocks: int = 16, chunk: int | None = None, sinks: int = 0
):
    groups = [CacheGroupSpec(0, "sliding_window", block_size, window, sinks)]
    return KVCacheManager(groups, num_blocks, enable_caching=True, max_chunk_tokens=chunk)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, max_tokens=100, arrival_index=0)


def decode(kv: KVCacheManager, r: Request, token: int) -> list[list[int]]:
    ids = kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    r.append_output_token(token)
    return ids


def test_blocks_leave_the_table_as_they_leave_the_window() -> None:
    kv = window_manager(window=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) == [[1, 2, 3]]
    r.num_computed_tokens = 10
    r.append_output_token(100)  # token 10, to be computed next
    assert decode(kv, r, 101) == [[1, 2, 3]]  # position 10 reads 3..10: block 0 is still needed
    assert decode(kv, r, 102) == [[0, 2, 3]]  # position 11 reads 4..11: block 0 (positions 0-3) leaves
    assert decode(kv, r, 103) == [[0, 2, 3, 4]]  # position 12 opens a fourth table entry
    held = [kv.blocks_per_group()[0]]
    for t in range(104, 140):
        ids = decode(kv, r, t)[0]
        held.append(kv.blocks_per_group()[0])
        assert ids[: len(ids) - 3] == [0] * (len(ids) - 3)  # only the last three table entries are live
    assert max(held) <= -(-8 // 4) + 1
    kv.free(r)
    assert kv.num_used_blocks == 0


def test_freed_window_blocks_go_back_oldest_first() -> None:
    kv = window_manager(window=4, block_size=4, num_blocks=8)
    r = req("a", list(range(8)))
    assert kv.allocate_slots(r, 8) == [[1, 2]]
    r.num_computed_tokens = 8
    r.append_output_token(9)
    assert decode(kv, r, 10) == [[0, 2, 3]]  # position 8 reads 5..8: block 0 leaves, block 2 is new
    assert list(kv.block_pool._free_queue)[-1] == 1  # at the tail: a cached block, evicted last


def test_a_prefix_hit_needs_only_the_windows_blocks() -> None:
    kv = window_manager(window=8, block_size=4)
    a = req("a", list(range(20)))
    assert kv.allocate_slots(a, 20) == [[1, 2, 3, 4, 5]]
    a.num_computed_tokens = 20
    kv.free(a)
    b = req("b", list(range(20)) + [99])
    hits, num_tokens = kv.get_computed_blocks(b)
    # 20 tokens hit: the next token (position 20) reads 13..19, i.e. blocks 3 and 4; blocks 0-2 stand as null.
    assert num_tokens == 20 and [blk.block_id for blk in hits[0]] == [0, 0, 0, 4, 5]
    assert kv.allocate_slots(b, 1, hits) == [[0, 0, 0, 4, 5, 6]]


def test_a_hit_whose_window_blocks_were_evicted_is_shorter() -> None:
    kv = window_manager(window=8, block_size=4)
    a = req("a", list(range(20)))
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    kv.block_pool._evict(kv.block_pool.blocks[5])  # the last block's hash is gone
    hits, num_tokens = kv.get_computed_blocks(req("b", list(range(20)) + [99]))
    assert num_tokens == 16 and [blk.block_id for blk in hits[0]] == [0, 0, 3, 4]


def test_a_hit_a_block_short_holds_its_own_windows_blocks() -> None:
    """A draft layer's hits stop a block short (drop_last_hit_block): the shorter hit's window starts a block
    earlier, so it is looked up again, not cut from the longer one, whose table has the null block there."""
    kv = window_manager(window=8, block_size=4)
    kv.drop_last_hit_block = True
    a = req("a", list(range(20)))
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.free(a)
    b = req("b", list(range(20)) + [99])
    hits, num_tokens = kv.get_computed_blocks(b)
    # 16 tokens: position 16 reads 9..15, blocks 2 and 3 of the table (ids 3 and 4)
    assert num_tokens == 16 and [blk.block_id for blk in hits[0]] == [0, 0, 3, 4]
    assert kv.allocate_slots(b, 5, hits) == [[0, 0, 3, 4, 6, 7]]


@pytest.mark.parametrize("chunk, want", [(None, 25), (16, 7), (1, 3)])
def test_most_blocks_a_request_can_hold(chunk, want) -> None:
    kv = window_manager(window=8, block_size=4, chunk=chunk)
    assert kv.max_blocks_per_request(100) == want


def test_window_groups_are_validated() -> None:
    with pytest.raises(ValueError, match="window"):
        CacheGroupSpec(0, "sliding_window", 16)
    with pytest.raises(ValueError, match="window"):
        CacheGroupSpec(0, "full", 16, window=8)
    with pytest.raises(ValueError, match="window"):
        CacheGroupSpec(0, "sliding_window", 16, window=0)


def test_sink_blocks_stay_while_the_window_moves_on() -> None:
    kv = window_manager(window=8, block_size=4, sinks=5, num_blocks=24)  # sinks 0-4: blocks 0 and 1
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) == [[1, 2, 3]]
    r.num_computed_tokens = 10
    r.append_output_token(100)
    for t in range(101, 140):
        ids = decode(kv, r, t)[0]
        assert ids[:2] == [1, 2]  # the sink blocks never leave
        assert ids[2 : len(ids) - 3] == [0] * (len(ids) - 5)  # between them and the window: null blocks
    assert kv.blocks_per_group()[0] <= 2 + -(-8 // 4) + 1
    kv.free(r)
    assert kv.num_used_blocks == 0


def test_a_prefix_hit_with_sinks_needs_the_sink_and_window_blocks() -> None:
    kv = window_manager(window=8, block_size=4, sinks=4)
    a = req("a", list(range(24)))
    assert kv.allocate_slots(a, 24) == [[1, 2, 3, 4, 5, 6]]
    a.num_computed_tokens = 24
    kv.free(a)
    hits, num_tokens = kv.get_computed_blocks(req("b", list(range(24)) + [99]))
    # the next token (position 24) reads the sink block 0 and positions 17..23 (blocks 4 and 5)
    assert num_tokens == 24 and [blk.block_id for blk in hits[0]] == [1, 0, 0, 0, 5, 6]
    kv.block_pool._evict(kv.block_pool.blocks[1])  # the sink block's hash is gone: no hit at any length
    assert kv.get_computed_blocks(req("c", list(range(24)) + [99]))[1] == 0


def test_sinks_count_towards_the_most_blocks_a_request_holds() -> None:
    assert window_manager(window=8, block_size=4, chunk=16, sinks=6).max_blocks_per_request(100) == 7 + 2
    with pytest.raises(ValueError, match="sinks"):
        CacheGroupSpec(0, "full", 16, sinks=4)


def test_a_step_scheduled_ahead_holds_what_the_plain_schedule_would() -> None:
    """Asynchronous scheduling: the step behind one in flight frees the blocks that leave the window there (the
    device runs any new owner's step after it), so its table is the one schedule() builds once that step is
    applied."""
    from mlaserve.core.scheduler import Scheduler, SchedulerConfig

    def scheduler() -> Scheduler:
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
        sched = Scheduler(config, window_manager(window=8, block_size=4, num_blocks=32))
        sched.add_request(req("a", list(range(10))))
        sched.update_from_output(sched.schedule(), {"a": 100})  # 10 prompt tokens, token 10 sampled
        return sched

    plain, ahead = scheduler(), scheduler()
    for token in range(101, 121, 2):
        step = plain.schedule()
        plain.update_from_output(step, {"a": token})
        after = plain.schedule()  # what schedule() builds once `step` is applied
        in_flight = ahead.schedule()
        queued = ahead.schedule_lookahead(in_flight)  # the same step, built before `in_flight` is applied
        assert queued.scheduled[0].block_ids == after.scheduled[0].block_ids
        assert ahead.kv_cache_manager.num_used_blocks == plain.kv_cache_manager.num_used_blocks
        ahead.update_from_output(in_flight, {"a": token})
        ahead.update_from_output(queued, {"a": token + 1})
        plain.update_from_output(after, {"a": token + 1})
