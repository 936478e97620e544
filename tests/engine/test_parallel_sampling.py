"""SamplingParams(n=...) in the offline API: one RequestOutput with n samples that share the prompt's KV blocks."""

from __future__ import annotations

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.parallel_sampling import child_params

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=128, block_size=16)
PROMPT = {"prompt_token_ids": list(range(3, 43))}  # 40 tokens: two full blocks and a part


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama), **OPTIONS)


def test_child_params_derive_seeds_and_score_the_prompt_once():
    children = child_params(SamplingParams(n=3, seed=7, prompt_logprobs=2), score_prompt_once=True)
    assert [c.seed for c in children] == [7, 8, 9] and {c.n for c in children} == {1}
    assert [c.prompt_logprobs for c in children] == [2, None, None]
    assert [c.seed for c in child_params(SamplingParams(n=2))] == [None, None]
    assert child_params(SamplingParams(n=2, prompt_logprobs=1))[1].prompt_logprobs == 1


def test_n_samples_are_distinct_seeded_and_repeat(llm):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # child i is the request with seed 11 + i, as the server samples choice i
    single = SamplingParams(seed=12, temperature=1.0, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPT, single, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[1].token_ids


def test_greedy_n_gives_n_equal_samples(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)
    assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids


def test_n_holds_the_prompt_blocks_once_and_frees_them(llm):
    engine = llm.engine
    engine.kv_manager.reset_prefix_cache()
    before = engine.stats()
    params = SamplingParams(n=3, seed=1, max_tokens=4, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    request_id = engine.add_request(PROMPT, params)
    outputs = engine.step()
    # child 0 holds 3 blocks (two full, one part); the others read its two full blocks and add their own part
    assert engine.stats()["kv_blocks_used"] == 3 + 2 * 1
    assert engine.stats()["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * 32
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = [o for o in outputs if o.finished]
    assert [o.request_id for o in finals] == [request_id]
    assert len(finals[0].outputs) == 3 and finals[0].prompt_logprobs is not None
    assert engine.stats()["kv_blocks_used"] == 0


def test_abort_of_a_parent_aborts_every_child(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    out = engine.abort_request(request_id)
    assert out is not None and out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0
