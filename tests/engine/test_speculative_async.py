"""Speculative decoding with asynchronous scheduling forced on (CPU). With MTP the step after a verify step is queued
before the verify step is read, its rows placed as if every draft held and settled once it is read
(runner/queued_verify.py); with prompt lookup a step that samples for a drafting request is read first, and only
steps that sample nothing are followed by a queued step. Greedy tokens equal the plain engine's with prompt lookup
(k = 3) and MTP (k = 1, 2), batched, chunked, preempted and with prefix hits, through the eager and the captured-step
paths; stops inside accepted drafts end where the plain engine ends; an abort while a step is queued leaves the
others' tokens alone; blocks come back; seeded sampled requests repeat themselves."""

from __future__ import annotations

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.runner.model_runner import ModelRunner
from tests.engine.test_mtp_draft_graphs import captured
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as ngram_prompts
from tests.engine.test_speculative_mtp import BASE, GREEDY, mtp, prompts, tokens
from tests.engine.test_speculative_sampled import sample

# An 8-token step chunks the prompts and caps the drafts; a first prompt longer than that makes a first step that
# samples nothing, which is queued behind. 16-24 blocks of 4 tokens hold fewer tokens than the requests need, so
# requests are preempted and recomputed.
SHORT = dict(max_num_batched_tokens=8, max_model_len=64, async_scheduling=True)
LONG_FIRST = [2, 1, 0, 3]  # the MTP prompts (5, 17, 30, 9 tokens), the 30-token one first


def watch_lookaheads(monkeypatch) -> dict[str, int]:
    """Counts the steps queued ahead: all of them, those queued behind a verify step, and those with rows placed
    before the accepted drafts were known. Prompt lookup reads its drafts from the tokens, so its engine never
    queues a step behind one that samples for a drafting request."""
    seen = {"ahead": 0, "behind_drafts": 0, "pending": 0, "queued_drafts": 0}
    original = ModelRunner.launch

    def launch(self, output, previous=None):
        if previous is not None:
            if self.drafter is None:
                assert not any(s.request.allow_drafts for s in previous.sampled)
                assert not any(s.lookahead for s in output.scheduled)
            seen["ahead"] += 1
            seen["behind_drafts"] += any(s.spec_token_ids for s in previous.output.scheduled)
            seen["pending"] += any(not s.settled for s in output.scheduled)
            seen["queued_drafts"] += any(not s.settled and s.spec_token_ids for s in output.scheduled)
        return original(self, output, previous)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    return seen


def run(path, batch, params, **options) -> tuple[list, LLM]:
    llm = LLM(str(path), **{**BASE, **options})
    return llm.generate(batch, params, use_tqdm=False), llm


@pytest.fixture(scope="module")
def ngram_plain(llama) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return tokens(run(llama, ngram_prompts(), params)[0])


def test_ngram_equals_the_plain_engine_chunked_preempted_and_with_hits(
    llama, ngram_plain, monkeypatch
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seen = watch_lookaheads(monkeypatch)
    outs, llm = run(llama, ngram_prompts(), params, num_kv_blocks=24, speculative_config=NGRAM, **SHORT)
    assert llm.engine.core.async_scheduling and tokens(outs) == ngram_plain
    again = llm.generate(ngram_prompts(), params, use_tqdm=False)  # the prompts' full blocks are cached now
    assert tokens(again) == ngram_plain
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["num_accepted_tokens"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0 and llm.engine.core._in_flight is None
    assert seen["ahead"] > 0  # prompt-chunk steps were still followed by a queued step


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_equals_the_plain_engine(mtp_models, monkeypatch, echo: bool, k: int) -> None:
    path, want = mtp_models[echo]
    batch, want = [prompts()[i] for i in LONG_FIRST], [want[i] for i in LONG_FIRST]
    seen = watch_lookaheads(monkeypatch)
    outs, llm = run(path, batch, GREEDY, speculative_config=mtp(k), num_kv_blocks=16, **SHORT)
    again = llm.generate(batch, GREEDY, use_tqdm=False)
    assert tokens(outs) == tokens(again) == want
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if echo:  # the draft layer's rows of steps queued ahead are the right ones: every draft holds
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    # Steps were queued behind verify steps, with rows placed before the accepted drafts were known.
    assert seen["behind_drafts"] > 0 and seen["pending"] > 0 and seen["queued_drafts"] > 0


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_through_captured_steps(mtp_models, monkeypatch, echo: bool, k: int) -> None:
    """The captured-step path (static inputs and the draft pass queued behind each decode or verify step, on the
    CPU stand-in), each pass's drafts checked against the eager drafter's: steps queued behind unread verify steps
    are corrected on the "device" from the accepted counts there (moved back where drafts were rejected)."""
    path, want = mtp_models[echo]
    batch, want = [prompts()[i] for i in LONG_FIRST], [want[i] for i in LONG_FIRST]
    seen = watch_lookaheads(monkeypatch)
    llm, graphs = captured(path, monkeypatch, speculative_config=mtp(k), **SHORT)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert len(graphs.compared) >= 4 and seen["behind_drafts"] > 0 and seen["queued_drafts"] > 0
    static = graphs.source
    assert static.sourced > 0 and static.shifted > 0
    if echo:  # every draft holds: nothing moves
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] and static.moved == 0
    else:
        assert static.moved > 0


def test_stops_inside_accepted_drafts(llama, monkeypatch) -> None:
    """max_tokens, stop ids and stop strings that end among a step's accepted drafts end the output where the
    plain engine ends it."""
    batch = ngram_prompts()[:3]  # the repeating ones: several drafts accepted per step
    plain, _ = run(llama, batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    cases = []
    for out in plain:
        ids, words = out.outputs[0].token_ids, out.outputs[0].text.split()
        cases.append(SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        cases.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[9]], ignore_eos=True))
        cases.append(
            SamplingParams(temperature=0, max_tokens=24, stop=[words[len(words) // 2]], ignore_eos=True)
        )
    requests = [p for p in batch for _ in range(3)]
    want, _ = run(llama, requests, cases)
    seen = watch_lookaheads(monkeypatch)
    got, llm = run(llama, requests, cases, speculative_config=NGRAM, **SHORT)
    ends = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got]
    assert ends == [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    assert {o.outputs[0].finish_reason for o in got} == {"stop", "length"}
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0 and seen["ahead"] > 0


def test_abort_while_a_step_is_queued(llama, ngram_plain) -> None:
    llm = LLM(str(llama), **BASE, speculative_config=NGRAM, **SHORT)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = ngram_prompts()[3:][::-1]  # 30, 17 and 5 tokens: the first step is a chunk of the first
    ids = [engine.add_request(p, params) for p in batch]
    finished = {}
    for out in engine.step(stream=False):
        finished[out.request_id] = out
    assert engine.core._in_flight is not None  # queued behind the first chunk
    queued = {s.request.request_id for s in engine.core._in_flight.output.scheduled}
    victim = next(rid for rid in reversed(ids) if rid in queued and rid not in finished)
    assert engine.abort_request(victim).outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    want = ngram_plain[3:][::-1]
    kept = [i for i, rid in enumerate(ids) if rid != victim]
    assert [finished[ids[i]].outputs[0].token_ids for i in kept] == [want[i] for i in kept]
    assert engine.stats()["kv_blocks_used"] == 0 and engine.core._in_flight is None


def test_seeded_sampled_requests_get_the_synchronous_engines_tokens(llama, monkeypatch) -> None:
    """The steps queued ahead are the ones the synchronous engine schedules, drafts and all, so each seeded
    request's generator makes the same draws."""
    seeds = range(24)
    options = dict(speculative_config=NGRAM, max_num_batched_tokens=16)  # a 24-token prompt: chunked
    want, _ = sample(llama, seeds, **options)
    seen = watch_lookaheads(monkeypatch)
    got, llm = sample(llama, seeds, async_scheduling=True, **options)
    again, _ = sample(llama, seeds, async_scheduling=True, **options)
    assert got == again == want
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0 and seen["ahead"] > 0


def test_asked_for_explicitly_it_keeps_speculation_and_the_draft_layer(mtp_models) -> None:
    path, _ = mtp_models[False]
    plain = LLM(str(path), **BASE).stats()["kv_bytes_per_token"]
    llm = LLM(str(path), **BASE, async_scheduling=True, speculative_config=mtp(2))
    stats = llm.stats()
    assert llm.engine.core.async_scheduling and stats["speculative_decoding"]
    assert stats["kv_bytes_per_token"] > plain  # the MTP layer's latent rows: one layer more


def test_mtp_stops_inside_accepted_drafts(mtp_models, monkeypatch) -> None:
    """The echo layer's drafts hold, so stops land among accepted drafts, with a step already queued behind."""
    path, want = mtp_models[True]
    batch = [prompts()[i] for i in LONG_FIRST]
    want = [want[i] for i in LONG_FIRST]
    cases = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[want[1][7]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[want[3][4]], ignore_eos=True),
    ]
    plain, _ = run(path, batch, cases)
    seen = watch_lookaheads(monkeypatch)
    got, llm = run(path, batch, cases, speculative_config=mtp(3), **SHORT)
    ends = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
    assert ends == [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain]
    assert [len(t) for t, _ in ends] == [6, want[1].index(want[1][7]) + 1, 9, want[3].index(want[3][4]) + 1]
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0 and seen["pending"] > 0


def test_mtp_abort_while_a_step_is_queued_behind_drafts(mtp_models) -> None:
    path, want = mtp_models[False]
    llm = LLM(str(path), **BASE, speculative_config=mtp(2), async_scheduling=True)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts()]
    finished = {}
    queued = None
    while queued is None:  # until a step is queued behind one that checked drafts
        for out in engine.step(stream=False):
            finished[out.request_id] = out
        ahead = engine.core._in_flight
        if ahead is not None and any(s.pending_drafts for s in ahead.output.scheduled):
            queued = ahead
    victim = next(s.request.request_id for s in queued.output.scheduled if s.pending_drafts)
    assert engine.abort_request(victim).outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    kept = [i for i, rid in enumerate(ids) if rid != victim]
    assert [finished[ids[i]].outputs[0].token_ids for i in kept] == [want[i] for i in kept]
    assert engine.stats()["kv_blocks_used"] == 0 and engine.core._in_flight is None


def test_mtp_seeded_sampled_requests_repeat(mtp_models, monkeypatch) -> None:
    path, _ = mtp_models[True]
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    seen = watch_lookaheads(monkeypatch)
    first, llm = run(path, prompts(), params, speculative_config=mtp(2), async_scheduling=True)
    second = llm.generate(prompts(), params, use_tqdm=False)
    third, _ = run(path, prompts(), params, speculative_config=mtp(2), async_scheduling=True)
    assert tokens(first) == tokens(second) == tokens(third)
    assert all(len(t) == 16 for t in tokens(first))
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0 and seen["queued_drafts"] > 0


def test_mtp_logprobs_match_the_synchronous_engines(mtp_models, monkeypatch) -> None:
    """Each kept token's logprobs come from its row of the queued step, as in the synchronous speculating engine."""
    path, want = mtp_models[True]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    sync, _ = run(path, prompts(), params, speculative_config=mtp(2))
    seen = watch_lookaheads(monkeypatch)
    got, llm = run(path, prompts(), params, speculative_config=mtp(2), async_scheduling=True)
    assert tokens(got) == tokens(sync) == [t[:10] for t in want]
    for g, s in zip(got, sync, strict=True):
        for a, b in zip(g.outputs[0].logprobs, s.outputs[0].logprobs, strict=True):
            assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert llm.stats()["num_accepted_tokens"] > 0 and seen["queued_drafts"] > 0
