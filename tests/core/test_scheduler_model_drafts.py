"""The scheduler with a draft model's drafts (ModelDrafts, the MTP method), torch-free: drafts taken only for the
tokens they were made after, slots past the step for the chained drafts' own rows, prefix hits a block short,
accepted drafts counted by position."""

from __future__ import annotations

import pytest

from mlaserve.spec_decode.model_drafts import ModelDrafts

from .conftest import make_scheduler


def drafting(k: int = 3, **options):
    sched = make_scheduler(**options)
    sched.proposer = ModelDrafts(k)
    sched.num_accepted_per_pos = [0] * k
    return sched


def test_lookahead_slots_and_drafts_for_the_tokens_they_follow(make_request) -> None:
    sched = drafting()
    request = make_request(list(range(10, 18)), allow_drafts=True)
    sched.add_request(request)
    out = sched.schedule()
    (item,) = out.scheduled
    # 8 prompt tokens and 2 slots for the second and third drafts' rows: 10 slots, 3 blocks of 4
    assert item.num_new_tokens == 8 and len(item.block_ids[0]) == 3
    sched.update_from_output(out, {request.request_id: 5})
    request.drafts_at, request.draft_token_ids = 9, [1, 2, 3]
    out = sched.schedule()
    (item,) = out.scheduled
    # the last token and 3 drafts from position 8, then 2 lookahead slots: 14 slots, 4 blocks
    assert item.spec_token_ids == [1, 2, 3] and item.num_new_tokens == 4 and len(item.block_ids[0]) == 4
    sched.update_from_output(out, {request.request_id: 7}, {request.request_id: 1})
    assert request.output_token_ids == [5, 1, 7] and request.num_computed_tokens == 10
    assert sched.num_accepted_per_pos == [1, 0, 0]
    # The drafts were made after 9 tokens; the request has 11 now: none are taken.
    (item,) = sched.schedule().scheduled
    assert item.spec_token_ids == [] and item.num_new_tokens == 1


def test_lookahead_stops_at_max_model_len(make_request) -> None:
    sched = drafting(max_model_len=9)
    request = make_request(list(range(10, 18)), max_tokens=1, allow_drafts=True)
    sched.add_request(request)
    (item,) = sched.schedule().scheduled
    assert len(item.block_ids[0]) == 3  # 8 tokens and the one slot left before max_model_len
    sched = drafting()
    other = make_request(list(range(10, 18)))  # no drafts: no lookahead
    sched.add_request(other)
    assert len(sched.schedule().scheduled[0].block_ids[0]) == 2


def test_prefix_hits_stop_a_block_short(make_request) -> None:
    """The draft layer's row at a position was made with the token after it: the last hit block's final row
    read the next block's first token, which the new request may not share."""
    for drop, want in ((False, 12), (True, 8)):
        sched = drafting()
        sched.kv_cache_manager.drop_last_hit_block = drop
        first = make_request(list(range(10, 23)), max_tokens=1)
        sched.add_request(first)
        sched.update_from_output(sched.schedule(), {first.request_id: 3})
        second = make_request(list(range(10, 22)) + [99])
        sched.add_request(second)
        (item,) = sched.schedule().scheduled
        assert item.num_computed_tokens == want, drop


def test_a_lookahead_takes_drafts_and_their_slots_behind_a_prompt_chunk(make_request) -> None:
    """A recomputed request's prompt chunk is in flight; the step queued behind it runs its last known token with
    the drafts made before, and takes the slots of both steps and of the chained drafts' rows."""
    sched = drafting(max_num_batched_tokens=9)
    # As a preempted request comes back: 9 prompt tokens and an output token known, none computed.
    request = make_request(list(range(10, 19)), allow_drafts=True, output_token_ids=[5])
    request.drafts_at, request.draft_token_ids = 10, [1, 2, 3]
    sched.add_request(request)
    first = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in first.scheduled] == [(0, 9)]
    ahead = sched.schedule_lookahead(first)
    (item,) = ahead.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.spec_token_ids) == (9, 4, [1, 2, 3])
    assert not item.lookahead and item.needs_sample
    # 9 computed by `first`, 4 here (the output token, 3 drafts), 2 lookahead slots: 15 slots, 4 blocks
    assert len(item.block_ids[0]) == 4
    sched.update_from_output(first, {request.request_id: 0})
    assert request.num_computed_tokens == 9 and request.output_token_ids == [5]
    sched.update_from_output(ahead, {request.request_id: 7}, {request.request_id: 3})
    assert request.output_token_ids == [5, 1, 2, 3, 7] and request.num_computed_tokens == 13


def drafting_step(sched, make_request, max_tokens: int = 16):
    """A request past its prompt (8 tokens, then 5) whose next step checks the drafts [1, 2]."""
    request = make_request(list(range(10, 18)), max_tokens=max_tokens, allow_drafts=True)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {request.request_id: 5})
    request.drafts_at, request.draft_token_ids = 9, [1, 2]
    return request, sched.schedule()


def test_a_lookahead_behind_drafts_takes_the_worst_case_and_settles(make_request) -> None:
    sched = drafting(k=2)
    request, first = drafting_step(sched, make_request)
    rid = request.request_id
    (item,) = first.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.spec_token_ids) == (8, 3, [1, 2])
    assert len(item.block_ids[0]) == 3  # 8 + 3 slots and 1 for the chained draft's row
    ahead = sched.schedule_lookahead(first)
    (row,) = ahead.scheduled
    # Placed as if both drafts hold: the token after them sits at 11, then 2 drafts of the pass after `first`.
    assert (row.num_computed_tokens, row.num_new_tokens, row.pending_drafts) == (11, 3, 2)
    assert row.lookahead and not row.settled and row.needs_sample and row.spec_token_ids == [0, 0]
    assert len(row.block_ids[0]) == 4  # slots up to 14, and 15 for the chained draft's row
    with pytest.raises(ValueError, match="num_accepted"):
        row.settle(3, [4, 6])
    row.settle(0, [4, 6, 9])  # both drafts rejected: the row moves back by two
    assert (row.num_computed_tokens, row.spec_token_ids, row.settled) == (9, [4, 6], True)
    sched.update_from_output(first, {rid: 7}, {rid: 0})
    assert request.output_token_ids == [5, 7] and request.num_computed_tokens == 9 and row.needs_sample
    # The block past the request's tokens stays: the queued step writes there.
    assert len(sched.kv_cache_manager.get_block_ids(rid)[0]) == 4
    sched.update_from_output(ahead, {rid: 8}, {rid: 0})
    assert request.output_token_ids == [5, 7, 8] and request.num_computed_tokens == 10
    assert len(sched.kv_cache_manager.get_block_ids(rid)[0]) == 3  # trimmed once nothing queued needs it


def test_an_unsettled_row_is_refused_and_a_possible_last_token_is_not_queued(make_request) -> None:
    sched = drafting(k=2)
    request, first = drafting_step(sched, make_request)
    ahead = sched.schedule_lookahead(first)
    sched.update_from_output(first, {request.request_id: 7}, {request.request_id: 2})
    with pytest.raises(ValueError, match="never settled"):
        sched.update_from_output(ahead, {request.request_id: 8})
    # max_tokens 4: with both drafts held, the token after them would be the fourth, so nothing is queued.
    sched = drafting(k=2)
    _, first = drafting_step(sched, make_request, max_tokens=4)
    assert sched.schedule_lookahead(first) is None
