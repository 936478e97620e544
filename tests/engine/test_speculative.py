"""Prompt-lookup speculative decoding gives greedy requests exactly the plain engine's tokens: batched, chunked,
preempted, with prefix hits and every kind of stop, on a tiny Llama and a tiny DeepSeek-V3 (MLA)."""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams

BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts(seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase (drafts found, often accepted) and random ones (drafts rejected)."""
    gen = torch.Generator().manual_seed(seed)
    repeating = [torch.randint(3, 250, (n,), generator=gen).tolist() * 4 for n in (3, 6, 9)]
    random = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    return [{"prompt_token_ids": p} for p in repeating + random]


def generate(path, batch, params, **options) -> tuple[list, LLM]:
    llm = LLM(str(path), **{**BASE, **options})
    return llm.generate(batch, params, use_tqdm=False), llm


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def model(request):
    path = request.getfixturevalue(request.param)
    plain, _ = generate(path, prompts(), GREEDY)
    return path, tokens(plain)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_the_plain_engines(model, k: int) -> None:
    path, want = model
    outs, llm = generate(path, prompts(), GREEDY, speculative_config={**NGRAM, "num_speculative_tokens": k})
    assert tokens(outs) == want
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["kv_blocks_used"] == 0
    assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["draft_acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    per_pos = stats["num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == stats["num_accepted_tokens"] and per_pos[0] > 0
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after every one before it
    assert stats["num_generated_tokens"] == sum(len(t) for t in want)


def test_chunked_preempted_and_prefix_hits(model) -> None:
    path, want = model
    batch, want = prompts()[1:5], want[1:5]
    # A step of 12 tokens chunks the prompts and caps the drafts; 24 blocks of 4 tokens hold about 96 of the 4
    # requests' up to 180, so requests are preempted and recomputed (largely from prefix hits).
    options = dict(max_num_batched_tokens=12, num_kv_blocks=24, max_model_len=64, speculative_config=NGRAM)
    outs, llm = generate(path, batch, GREEDY, **options)
    assert tokens(outs) == want
    again = llm.generate(batch, GREEDY, use_tqdm=False)  # the prompts' full blocks are cached now
    assert tokens(again) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_stops_hold_as_without_speculation(llama) -> None:
    """max_tokens, stop token ids, EOS and stop strings end the output at the same token; tokens the step
    accepted past the stop are dropped."""
    batch = prompts()[:3]  # the repeating ones: several tokens accepted per step
    plain, _ = generate(llama, batch, GREEDY)
    cases = []
    for out in plain:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        cases.append(SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        cases.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[9]], ignore_eos=True))
        words = text.split()
        cases.append(
            SamplingParams(temperature=0, max_tokens=24, stop=[words[len(words) // 2]], ignore_eos=True)
        )
    requests = [p for p in batch for _ in range(3)]
    want, _ = generate(llama, requests, cases)
    got, llm = generate(llama, requests, cases, speculative_config=NGRAM)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].text, g.outputs[0].finish_reason) == (
            w.outputs[0].text,
            w.outputs[0].finish_reason,
        )
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    assert llm.stats()["num_accepted_tokens"] > 0 and llm.stats()["kv_blocks_used"] == 0


def test_processed_and_plain_requests_share_verify_steps(llama) -> None:
    """Requests with logprobs, penalties or min_tokens take drafts in the same steps as plain ones: each row is
    processed as its own request asks (test_speculative_features.py checks each feature alone)."""
    batch = prompts()
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=2, logprobs=1),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=-0.3),
        GREEDY,
    ]
    want, _ = generate(llama, batch, params)
    got, llm = generate(llama, batch, params, speculative_config=NGRAM)
    assert tokens(got) == tokens(want)
    for w, g in zip(want[1:3], got[1:3], strict=True):
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert llm.stats()["num_accepted_tokens"] > 0 and llm.stats()["kv_blocks_used"] == 0


def test_logit_bias_requests_get_drafts_and_keep_their_tokens(llama) -> None:
    batch = prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={7: 2.0, 100: -5.0})
    want, _ = generate(llama, batch, params)
    got, llm = generate(llama, batch, params, speculative_config=NGRAM)
    assert tokens(got) == tokens(want)
    assert llm.stats()["num_accepted_tokens"] > 0 and llm.stats()["kv_blocks_used"] == 0
