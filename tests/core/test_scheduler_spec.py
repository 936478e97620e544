"""The scheduler with speculative drafts, torch-free: slots for the drafts or none, the budget and length caps,
accepted drafts kept and rejected slots given back, stops applied token by token."""

from __future__ import annotations

from mlaserve.core.request import RequestStatus
from mlaserve.spec_decode.ngram import NgramProposer

from .conftest import make_scheduler

PROMPT = [5, 6, 7, 8] * 3  # the last token recurs: drafts [5, 6, 7] follow it


def drafting(num_blocks: int = 64, budget: int = 64, k: int = 3, **options):
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, **options)
    sched.proposer = NgramProposer(k, 1, 2)
    return sched


def prefill_and_first_token(sched, make_request, prompt: list[int] = PROMPT, token: int = 5, **fields):
    request = make_request(list(prompt), allow_drafts=True, **fields)
    sched.add_request(request)
    while not request.output_token_ids:  # the prompt, in chunks of the budget
        sched.update_from_output(sched.schedule(), {request.request_id: token})
    return request


def test_drafts_scheduled_with_their_slots(make_request) -> None:
    sched = drafting()
    request = prefill_and_first_token(sched, make_request)  # tokens ... 7, 8, 5: [5] recurs, then 6, 7, 8
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.spec_token_ids == [6, 7, 8] and item.num_new_tokens == 4 and item.needs_sample
    assert len(item.block_ids[0]) == 4  # 12 computed + 4 new = 16 tokens in blocks of 4
    # Two drafts accepted, the model's token after them is 9: three tokens appended, 2 + 1 positions computed.
    sched.update_from_output(out, {request.request_id: 9}, {request.request_id: 2})
    assert request.output_token_ids == [5, 6, 7, 9]
    assert request.num_computed_tokens == 15 and request.num_tokens == 16
    assert sched.kv_cache_manager.get_block_ids(request.request_id)[0] == item.block_ids[0][:4]
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)


def test_rejected_drafts_give_their_blocks_back(make_request) -> None:
    sched = drafting()
    request = prefill_and_first_token(sched, make_request, PROMPT + [5, 6], token=7)
    out = sched.schedule()  # 14 computed + 4 new = 18 slots: 5 blocks
    assert out.scheduled[0].spec_token_ids == [8, 5, 6]
    used = sched.kv_cache_manager.num_used_blocks
    sched.update_from_output(out, {request.request_id: 3}, {request.request_id: 0})
    assert request.output_token_ids == [7, 3] and request.num_computed_tokens == 15
    assert sched.kv_cache_manager.num_used_blocks == used - 1  # the block of positions 16.. held only drafts


def test_a_stop_inside_the_accepted_drafts_drops_the_rest(make_request) -> None:
    sched = drafting()
    request = prefill_and_first_token(sched, make_request, stop_token_ids=(6,))
    out = sched.schedule()
    finished = sched.update_from_output(out, {request.request_id: 9}, {request.request_id: 3})
    assert finished == [request] and request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, 6]


def test_drafts_capped_by_max_tokens_budget_and_max_model_len(make_request) -> None:
    sched = drafting()
    prefill_and_first_token(sched, make_request, max_tokens=3)
    assert sched.schedule().scheduled[0].spec_token_ids == [6]  # 1 output + 1 draft + 1 token = 3
    sched = drafting(budget=3)
    prefill_and_first_token(sched, make_request)
    assert sched.schedule().scheduled[0].spec_token_ids == [6, 7]
    sched = drafting(max_model_len=15)
    prefill_and_first_token(sched, make_request)
    assert sched.schedule().scheduled[0].spec_token_ids == [6]  # 13 tokens + 1 draft + 1 token = 15


def test_short_pool_schedules_without_drafts_and_never_preempts_for_them(make_request) -> None:
    # 8 usable blocks: the drafted request's 12 tokens fill 3, the other's 19 (+ its decode) 5; drafts need a 9th.
    sched = drafting(num_blocks=9)
    request = make_request(PROMPT[:11], max_tokens=8, allow_drafts=True)
    other = make_request(19, max_tokens=2)
    sched.add_request(request)
    sched.add_request(other)
    sched.update_from_output(sched.schedule(), {request.request_id: 8, other.request_id: 1})
    assert sched.kv_cache_manager.num_free_blocks == 0
    out = sched.schedule()  # [7, 8] recurs: drafts [5, 6, 7] would need a block of their own
    assert [(s.request, s.spec_token_ids, s.num_new_tokens) for s in out.scheduled] == [
        (request, [], 1),
        (other, [], 1),
    ]
    assert not out.preempted_request_ids


def test_requests_that_do_not_allow_drafts_get_none(make_request) -> None:
    sched = drafting()
    request = make_request(list(PROMPT))
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {request.request_id: 5})
    assert sched.schedule().scheduled[0].spec_token_ids == []


def test_a_lookahead_gives_drafts_only_to_rows_whose_input_is_known(make_request) -> None:
    """Prefill-first: r1's prompt step runs alone while r0 waits with its first token. The step queued behind it
    gives r0 (all its tokens on the host) its drafts as schedule() would, and r1 (its input still being sampled)
    a plain lookahead row."""
    sched = drafting(prefill_first=True)
    r0 = prefill_and_first_token(sched, make_request)  # tokens ... 7, 8, 5: drafts [6, 7, 8]
    r1 = make_request(6, allow_drafts=True)
    sched.add_request(r1)
    first = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in first.scheduled] == [(r1, 6)]
    ahead = sched.schedule_lookahead(first)
    rows = [
        (s.request, s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids, s.lookahead)
        for s in ahead.scheduled
    ]
    assert rows == [(r0, 12, 4, [6, 7, 8], False), (r1, 6, 1, [], True)]
    assert [len(s.block_ids[0]) for s in ahead.scheduled] == [4, 2]  # 16 slots; r1's 7th token opens a block
    sched.update_from_output(first, {r1.request_id: 9})
    sched.update_from_output(ahead, {r0.request_id: 9, r1.request_id: 3}, {r0.request_id: 2})
    assert r0.output_token_ids == [5, 6, 7, 9] and r1.output_token_ids == [9, 3]
    assert r0.num_computed_tokens == 15 and (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)
    assert len(sched.kv_cache_manager.get_block_ids(r0.request_id)[0]) == 4  # 16 tokens fill 4 blocks
