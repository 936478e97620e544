import pytest

from mlaserve.core.request import RequestStatus
from mlaserve.core.scheduler import SchedulerConfig, SchedulerOutput

from .conftest import make_scheduler


def step(sched, token: int = 7) -> tuple[SchedulerOutput, list]:
    """One engine step with a fake model that samples `token` for every request that needs a sample."""
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.needs_sample}
    finished = sched.update_from_output(out, sampled)
    sched.release_finished()  # as the engine does once the step's outputs are sent
    return out, finished


def summary(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_continuous_batching(make_request) -> None:
    sched = make_scheduler()
    r0 = make_request(6, max_tokens=3)
    sched.add_request(r0)
    out, _ = step(sched)
    assert summary(out) == [("r0", 0, 6)] and out.num_batched_tokens == 6
    assert out.scheduled[0].block_ids == [[1, 2]] and out.scheduled[0].needs_sample
    r1 = make_request(5, max_tokens=2)
    sched.add_request(r1)
    out, _ = step(sched)
    assert summary(out) == [("r0", 6, 1), ("r1", 0, 5)] and out.num_batched_tokens == 6
    assert [s.block_ids for s in out.scheduled] == [[[1, 2]], [[3, 4]]]
    out, finished = step(sched)
    assert summary(out) == [("r0", 7, 1), ("r1", 5, 1)]
    assert finished == [r0, r1]
    assert r0.output_token_ids == [7, 7, 7] and r1.output_token_ids == [7, 7]
    assert r0.status is RequestStatus.FINISHED_LENGTH and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0 and sched.schedule().is_empty


def test_finished_blocks_go_back_at_release_or_at_the_next_schedule(make_request) -> None:
    sched = make_scheduler()
    r0 = make_request(6, max_tokens=1)
    sched.add_request(r0)
    out = sched.schedule()
    assert sched.update_from_output(out, {"r0": 7}) == [r0] and r0.is_finished
    kv = sched.kv_cache_manager
    assert kv.num_used_blocks == 2  # the last token goes out before the pool takes its blocks back
    sched.release_finished()
    assert kv.num_used_blocks == 0
    r1 = make_request(6, max_tokens=1)
    sched.add_request(r1)
    out = sched.schedule()
    sched.update_from_output(out, {"r1": 7})
    assert sched.schedule().is_empty and kv.num_used_blocks == 0  # the next schedule frees them if no one did


def test_chunked_prefill_small_budget(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    r0 = make_request(20, max_tokens=2)
    sched.add_request(r0)
    out = sched.schedule()
    assert summary(out) == [("r0", 0, 8)] and not out.scheduled[0].needs_sample
    sched.update_from_output(out, {"r0": 5})  # a token sampled mid-prompt is ignored
    assert r0.output_token_ids == [] and r0.num_computed_tokens == 8
    sched.add_request(make_request(6, max_tokens=2))
    out, _ = step(sched)
    assert summary(out) == [("r0", 8, 8)]  # budget spent on r0, r1 waits
    out, _ = step(sched)
    assert summary(out) == [("r0", 16, 4), ("r1", 0, 4)]
    assert [s.needs_sample for s in out.scheduled] == [True, False]
    out, _ = step(sched)
    assert summary(out) == [("r0", 20, 1), ("r1", 4, 2)]
    out, finished = step(sched)
    assert summary(out) == [("r1", 6, 1)] and [r.request_id for r in finished] == ["r1"]


def test_prefill_first_holds_decodes_while_prompts_wait(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=8, prefill_first=True)
    r0 = make_request(4, max_tokens=4)
    sched.add_request(r0)
    step(sched)
    r1, r2 = make_request(6, max_tokens=2), make_request(6, max_tokens=2)
    sched.add_request(r1)
    sched.add_request(r2)
    out, _ = step(sched)
    assert summary(out) == [("r1", 0, 6), ("r2", 0, 2)]  # r0 decodes nothing while prompts wait
    out, _ = step(sched)
    assert summary(out) == [("r2", 2, 4)]  # a running prompt's next chunk counts as waiting work too
    out, _ = step(sched)
    assert summary(out) == [("r0", 4, 1), ("r1", 6, 1), ("r2", 6, 1)]  # all in: decodes resume together
    assert r0.output_token_ids == [7, 7]


def test_prefill_first_decodes_when_no_prompt_can_be_admitted(make_request) -> None:
    # max_num_seqs full: the waiting prompt cannot start, so the running ones must decode (and finish) first
    sched = make_scheduler(max_num_seqs=1, prefill_first=True)
    r0, r1 = make_request(4, max_tokens=2), make_request(4, max_tokens=2)
    sched.add_request(r0)
    sched.add_request(r1)
    assert summary(step(sched)[0]) == [("r0", 0, 4)]
    assert summary(step(sched)[0]) == [("r0", 4, 1)]
    assert summary(step(sched)[0]) == [("r1", 0, 4)]
    # the pool full: 3 blocks of 4 tokens; r2 holds 2, r3's 8-token prompt needs 2 more
    sched = make_scheduler(num_blocks=4, prefill_first=True)
    r2, r3 = make_request(5, max_tokens=3), make_request(8, max_tokens=1)
    sched.add_request(r2)
    step(sched)
    sched.add_request(r3)
    assert summary(step(sched)[0]) == [("r2", 5, 1)]
    assert summary(step(sched)[0]) == [("r2", 6, 1)]
    assert summary(step(sched)[0]) == [("r3", 0, 8)]


def test_chunked_prefill_disabled_waits_for_whole_prompt(make_request) -> None:
    sched = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    for _ in range(3):
        sched.add_request(make_request(20, max_tokens=4))
    out, _ = step(sched)
    assert summary(out) == [("r0", 0, 20)]
    out, _ = step(sched)
    assert summary(out) == [("r0", 20, 1), ("r1", 0, 20)]
    out, _ = step(sched)  # 30 tokens of budget left after the decodes: r2's whole prompt fits
    assert summary(out) == [("r0", 21, 1), ("r1", 20, 1), ("r2", 0, 20)]


def test_max_num_seqs(make_request) -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(4, max_tokens=n) for n in (1, 3, 1)]
    for r in reqs:
        sched.add_request(r)
    out, finished = step(sched)
    assert summary(out) == [("r0", 0, 4), ("r1", 0, 4)] and finished == [reqs[0]]
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    out, _ = step(sched)
    assert summary(out) == [("r1", 4, 1), ("r2", 0, 4)]


def test_preempts_newest_and_recovers(make_request) -> None:
    sched = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks, 16 slots
    r0 = make_request(7, max_tokens=4, ignore_eos=True)
    r1 = make_request(7, max_tokens=6, ignore_eos=True)
    sched.add_request(r0)
    sched.add_request(r1)
    out, _ = step(sched)
    assert [s.block_ids for s in out.scheduled] == [[[1, 2]], [[3, 4]]]
    step(sched)  # both at 9 tokens now, pool full
    out, _ = step(sched)  # r0 needs a 3rd block: r1 (newest) is preempted
    assert summary(out) == [("r0", 8, 1)] and out.preempted_request_ids == ["r1"]
    assert out.scheduled[0].block_ids == [[1, 2, 4]]  # r1 freed tail first: block 4 is reused first
    assert r1.status is RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert (r1.num_preemptions, sched.num_preemptions) == (1, 1)
    assert list(sched.waiting) == [r1] and sched.running == [r0]
    out, finished = step(sched)  # r1 still cannot fit (needs 3 blocks, 1 free); r0 finishes
    assert summary(out) == [("r0", 9, 1)] and finished == [r0]
    out, _ = step(sched)  # r1 resumes: its first block (3) is still a prefix hit; outputs recomputed too
    assert summary(out) == [("r1", 4, 5)] and r1.num_cached_tokens == 0
    assert out.scheduled[0].block_ids[0][0] == 3
    while sched.has_unfinished_requests():
        step(sched)
    assert r0.num_output_tokens == 4 and r1.num_output_tokens == 6
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_newest_request_preempts_itself(make_request) -> None:
    sched = make_scheduler(num_blocks=5, block_size=4)
    r0 = make_request(5, max_tokens=8, ignore_eos=True)
    r1 = make_request(7, max_tokens=8, ignore_eos=True)
    sched.add_request(r0)
    sched.add_request(r1)
    step(sched)
    step(sched)
    out, _ = step(
        sched
    )  # r0 (7 tokens) fits in its 2 blocks; r1 (9) needs a 3rd: it is the newest, so it goes
    assert summary(out) == [("r0", 6, 1)] and out.preempted_request_ids == ["r1"]
    assert sched.running == [r0] and list(sched.waiting) == [r1]


@pytest.mark.parametrize(
    ("fields", "tokens", "status", "num_outputs"),
    [
        ({"eos_token_id": 2}, [5, 2, 5], RequestStatus.FINISHED_STOPPED, 2),
        ({"eos_token_id": 2, "ignore_eos": True}, [2, 2, 2, 2, 2], RequestStatus.FINISHED_LENGTH, 5),
        ({"stop_token_ids": (9, 11)}, [5, 5, 11], RequestStatus.FINISHED_STOPPED, 3),
        ({}, [5] * 5, RequestStatus.FINISHED_LENGTH, 5),
    ],
)
def test_stop_conditions(make_request, fields, tokens, status, num_outputs) -> None:
    sched = make_scheduler()
    r = make_request(3, max_tokens=5, **fields)
    sched.add_request(r)
    finished = []
    for token in tokens:
        _, finished = step(sched, token)
        if finished:
            break
    assert finished == [r] and r.status is status
    assert r.output_token_ids == tokens[:num_outputs]  # a stop token is kept in the output
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()


@pytest.mark.parametrize(("prompt_len", "num_outputs"), [(14, 2), (16, 1)])
def test_stop_at_max_model_len(make_request, prompt_len, num_outputs) -> None:
    sched = make_scheduler(max_model_len=16)
    r = make_request(prompt_len, max_tokens=10)
    sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == num_outputs


def test_finish_request_waiting_running_and_in_flight(make_request) -> None:
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request(6), make_request(6)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv_cache_manager.num_used_blocks == 2
    assert sched.finish_request(waiting.request_id, RequestStatus.FINISHED_ABORTED) is waiting
    assert waiting.status is RequestStatus.FINISHED_ABORTED and sched.num_waiting == 0
    out = sched.schedule()
    # Aborted after schedule(), before update_from_output (e.g. a stop string): blocks freed, update skips it.
    assert sched.finish_request(running.request_id, RequestStatus.FINISHED_STOPPED) is running
    assert sched.update_from_output(out, {running.request_id: 3}) == []
    assert running.num_output_tokens == 1 and sched.kv_cache_manager.num_used_blocks == 0
    assert sched.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None
    assert not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_request("x", RequestStatus.RUNNING)


def test_lookahead_schedules_the_next_decode_before_the_tokens_arrive(make_request) -> None:
    sched = make_scheduler(block_size=4)
    r0, r1 = make_request(6, max_tokens=2), make_request(8, max_tokens=5, eos_token_id=9)
    sched.add_request(r0)
    sched.add_request(r1)
    first = sched.schedule()
    ahead = sched.schedule_lookahead(first)
    # Positions 6 and 8, the tokens `first` samples; r1's needs a third block, taken now.
    assert summary(ahead) == [("r0", 6, 1), ("r1", 8, 1)]
    assert all(s.lookahead and s.needs_sample for s in ahead.scheduled)
    assert [s.block_ids for s in ahead.scheduled] == [[[1, 2]], [[3, 4, 5]]]
    assert sched.update_from_output(first, {"r0": 7, "r1": 7}) == []
    assert r0.num_computed_tokens == 6 and r0.output_token_ids == [7]
    # Scheduled before `ahead` is applied: r0's token from `ahead` is its last (max_tokens 2), so r0 is left out.
    third = sched.schedule_lookahead(ahead)
    assert summary(third) == [("r1", 9, 1)]
    assert sched.update_from_output(ahead, {"r0": 7, "r1": 9}) == [r0, r1]  # r1 stops on EOS
    assert r1.output_token_ids == [7, 9] and r1.status is RequestStatus.FINISHED_STOPPED
    assert sched.update_from_output(third, {"r1": 7}) == []  # r1's wasted row is skipped
    sched.release_finished()
    assert r1.output_token_ids == [7, 9] and sched.kv_cache_manager.num_used_blocks == 0


def test_lookahead_admits_waiting_requests_and_never_preempts(make_request) -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=8)
    r0 = make_request(7, max_tokens=8)
    sched.add_request(r0)
    first = sched.schedule()
    r1 = make_request(4, max_tokens=4)
    sched.add_request(r1)
    # r0's decode (its input is the token `first` samples) and r1's prompt, as schedule() would pick them next.
    ahead = sched.schedule_lookahead(first)
    assert summary(ahead) == [("r0", 7, 1), ("r1", 0, 4)]
    assert [s.lookahead for s in ahead.scheduled] == [True, False] and not sched.waiting
    sched.update_from_output(first, {"r0": 7})
    # Pool: 4 blocks, 3 taken; r0's next token takes the fourth, r1's finds none. Lookahead never preempts.
    assert sched.schedule_lookahead(ahead) is None and sched.num_preemptions == 0
    sched.update_from_output(ahead, {"r0": 8, "r1": 9})
    assert r0.output_token_ids == [7, 8] and r1.output_token_ids == [9]


def test_lookahead_continues_a_chunked_prompt(make_request) -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    r0 = make_request(10, max_tokens=2)
    sched.add_request(r0)
    first = sched.schedule()
    # As the engine runs it: each step scheduled ahead while the one before it is in flight, then that one applied.
    second = sched.schedule_lookahead(first)  # mid-prompt: nothing sampled, the next chunk's tokens are known
    assert summary(second) == [("r0", 4, 4)] and not second.scheduled[0].lookahead
    sched.update_from_output(first, {"r0": 1})  # tokens sampled mid-prompt are ignored
    third = sched.schedule_lookahead(second)
    assert summary(third) == [("r0", 8, 2)] and third.scheduled[0].needs_sample
    sched.update_from_output(second, {"r0": 2})
    fourth = sched.schedule_lookahead(third)
    assert summary(fourth) == [("r0", 10, 1)] and fourth.scheduled[0].lookahead
    sched.update_from_output(third, {"r0": 7})
    assert r0.num_computed_tokens == 10 and r0.output_token_ids == [7]
    assert sched.schedule_lookahead(fourth) is None  # max_tokens 2: the token `fourth` samples is the last
    assert sched.update_from_output(fourth, {"r0": 8}) == [r0] and r0.output_token_ids == [7, 8]


def test_lookahead_after_a_prefill_only_step(make_request) -> None:
    """Prefill-first: each prompt's step holds prompts alone, while the requests prefilled before it wait with
    their first tokens; the prompt steps and the decode step after them are all queued ahead. The decode step's
    rows of earlier prompts are ordinary decode rows, the last prompt's row takes the token its step samples."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6, prefill_first=True)
    r0, r1 = make_request(6, max_tokens=4), make_request(5, max_tokens=4)
    sched.add_request(r0)
    sched.add_request(r1)
    first = sched.schedule()
    assert summary(first) == [("r0", 0, 6)]
    second = sched.schedule_lookahead(first)
    assert summary(second) == [("r1", 0, 5)]  # r1 waits: the prompt goes first
    sched.update_from_output(first, {"r0": 7})
    ahead = sched.schedule_lookahead(second)
    assert summary(ahead) == [("r0", 6, 1), ("r1", 5, 1)]  # schedule()'s order: oldest first
    assert [s.lookahead for s in ahead.scheduled] == [False, True]
    assert all(s.needs_sample for s in ahead.scheduled)
    sched.update_from_output(second, {"r1": 8})
    sched.update_from_output(ahead, {"r0": 9, "r1": 9})
    assert r0.output_token_ids == [7, 9] and r1.output_token_ids == [8, 9]


def test_prefix_hit_on_first_schedule(make_request) -> None:
    sched = make_scheduler()
    sched.add_request(make_request(list(range(10)), max_tokens=1))
    step(sched)
    r1 = make_request(list(range(10)) + [42, 43], max_tokens=1)
    sched.add_request(r1)
    out, _ = step(sched)
    assert summary(out) == [("r1", 8, 4)] and r1.num_cached_tokens == 8
    assert out.scheduled[0].block_ids == [[1, 2, 4]]
    assert sched.kv_cache_manager.prefix_cache_stats() == {"queries": 22, "hits": 8}


def test_add_request_validation(make_request) -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)
    sched.add_request(make_request(4, max_tokens=1, request_id="dup"))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request(4, max_tokens=1, request_id="dup"))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request([]))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(make_request(4, max_tokens=0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(33))
    with pytest.raises(ValueError, match="KV blocks|blocks, but"):
        sched.add_request(make_request(10, max_tokens=8))  # 17 tokens of KV > 16 slots
    sched.add_request(make_request(10, max_tokens=7))  # 16 tokens of KV: fits exactly


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 1.5}, "max_model_len"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        (
            {"max_num_batched_tokens": 16, "enable_chunked_prefill": False},
            "max_num_batched_tokens.*max_model_len",
        ),
    ],
)
def test_scheduler_config_validation(kwargs, match) -> None:
    base = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 32}
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**{**base, **kwargs})
