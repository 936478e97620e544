"""Requests with logprobs, penalties, min_tokens, grammars, n > 1 and stop strings take speculative drafts and give
what they give without them: greedy tokens, logprobs (within 1e-5 on float32), finish reasons and text, for
prompt-lookup drafts (k = 3) on a tiny Llama and DeepSeek MTP drafts (k = 2) on a tiny DeepSeek-V3."""

from __future__ import annotations

import math
import re

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.spec_decode.model_drafts import ModelDrafts
from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny

BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
EOS = 1  # the word tokenizer's "w1"

FEATURES = {
    "logprobs": dict(logprobs=3),
    "logprobs_0": dict(logprobs=0),
    # Negative presence and frequency penalties and a repetition penalty below 1 favour repeats, so drafts taken
    # from the repeating prompts are still often accepted.
    "presence": dict(presence_penalty=-0.5),
    "frequency": dict(frequency_penalty=-0.3),
    "repetition": dict(repetition_penalty=0.8),
    "all_penalties": dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8, logprobs=2),
    # EOS is the argmax wherever it is allowed: the output is exactly min_tokens tokens, then EOS.
    "min_tokens_6": dict(min_tokens=6, ignore_eos=False, logit_bias={EOS: 100.0}),
    "min_tokens_9": dict(min_tokens=9, ignore_eos=False, logit_bias={EOS: 100.0}),
}


def prompts(seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase (drafts found, often accepted) and random ones (drafts rejected)."""
    gen = torch.Generator().manual_seed(seed)
    repeating = [torch.randint(3, 250, (n,), generator=gen).tolist() * 4 for n in (3, 6, 9)]
    random = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 17)]
    return [{"prompt_token_ids": p} for p in repeating + random]


def assert_same_outputs(want: list, got: list) -> None:
    """Tokens, text, finish and stop reasons equal; logprobs equal within 1e-5 (same tokens, same ranks)."""
    for w, g in zip(want, got, strict=True):
        assert len(w.outputs) == len(g.outputs)
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is None:
                continue
            assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
            for position, (ea, eb) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
                assert list(eb) == list(ea), position
                for token, lp in ea.items():
                    assert eb[token].rank == lp.rank, (position, token)
                    assert math.isclose(eb[token].logprob, lp.logprob, abs_tol=1e-5), (position, token)
            assert math.isclose(b.cumulative_logprob, a.cumulative_logprob, abs_tol=1e-4)


class Engines:
    """A plain engine and a speculative one on the same model; each comparison reports the drafts it made."""

    def __init__(self, path, spec: dict, **options) -> None:
        self.plain = LLM(str(path), **{**BASE, **options})
        self.spec = LLM(str(path), **{**BASE, **options}, speculative_config=spec)

    def compare(self, batch, params) -> tuple[int, int]:
        """(drafts verified, drafts accepted) for this batch, after checking the outputs are equal."""
        before = self.spec.stats()
        want = self.plain.generate(batch, params, use_tqdm=False)
        got = self.spec.generate(batch, params, use_tqdm=False)
        assert_same_outputs(want, got)
        after = self.spec.stats()
        assert after["kv_blocks_used"] == 0 and self.plain.stats()["kv_blocks_used"] == 0
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        return drafted, after["num_accepted_tokens"] - before["num_accepted_tokens"]


@pytest.fixture(scope="module")
def ngram_llama(llama):
    return Engines(llama, NGRAM)


@pytest.fixture(scope="module")
def mtp_v3(tmp_path_factory):
    """The echo case (mtp_checkpoint.py): drafts the plain model agrees with, so accepted drafts' rows matter; the
    penalties and min_tokens change the target, so drafts are also rejected."""
    plain = build_tiny("deepseek_v3", tmp_path_factory.mktemp("v3"))
    return Engines(add_mtp_layer(plain, tmp_path_factory.mktemp("v3_echo"), echo=True), MTP)


@pytest.fixture(params=["ngram_llama", "mtp_v3"])
def engines(request) -> Engines:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_feature_equals_the_plain_engine(engines: Engines, feature: str) -> None:
    fields = {"ignore_eos": True, **FEATURES[feature]}
    params = SamplingParams(temperature=0, max_tokens=20, **fields)
    drafted, accepted = engines.compare(prompts(), params)
    assert drafted > 0 and accepted > 0


def test_min_tokens_holds_back_a_stop_id_that_drafts_propose(engines: Engines, monkeypatch) -> None:
    """Stop ids held back by min_tokens. MTP drafts propose them at rows whose would-be length is below min_tokens,
    where they must be banned, and at rows past it, where they stop the output; prompt-lookup drafts here seldom do
    (tests/runner/test_draft_processing.py checks those rows on their own)."""
    batch = prompts()[:3]
    plain = engines.plain.generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    params = []
    for prompt, out in zip(batch, plain, strict=True):
        ids = out.outputs[0].token_ids
        # the output's third token (an MTP draft after its first) and its first token that the prompt holds (a
        # prompt-lookup draft once the output follows the prompt's phrase)
        copied = next((t for t in ids[1:] if t in prompt["prompt_token_ids"]), ids[1])
        cases = [(ids[2], 2), (ids[2], 4), (copied, 3), (copied, 6)]
        for stop, min_tokens in cases:
            fields = dict(stop_token_ids=[stop], min_tokens=min_tokens, logprobs=1)
            params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **fields))
    seen = []
    proposer = type(engines.spec.engine.core.scheduler.proposer)
    propose = proposer.drafts_for

    def record(self, request, max_tokens):
        drafts = propose(self, request, max_tokens)
        held = request.sampling_params.min_tokens - request.num_output_tokens
        seen.extend(j < held for j, t in enumerate(drafts) if t in request.stop_token_ids)
        return drafts

    monkeypatch.setattr(proposer, "drafts_for", record)
    drafted, _ = engines.compare([p for p in batch for _ in range(4)], params)
    assert drafted > 0
    if proposer is ModelDrafts:  # the echo layer proposes the plain output, stop ids included
        assert True in seen and False in seen


def test_stop_strings_and_logprobs_end_inside_accepted_drafts(engines: Engines) -> None:
    """A stop string or stop id that ends among a step's accepted drafts cuts the tokens, text and logprobs where
    the plain engine stops."""
    batch = prompts()[:3]
    plain = engines.plain.generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    params = []
    for out in plain:
        ids, words = out.outputs[0].token_ids, out.outputs[0].text.split()
        for at in (5, 9, 13):
            params.append(
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[words[at]], logprobs=2)
            )
            params.append(
                SamplingParams(
                    temperature=0,
                    max_tokens=20,
                    ignore_eos=True,
                    stop_token_ids=[ids[at]],
                    logprobs=1,
                    presence_penalty=0.2,
                )
            )
    drafted, accepted = engines.compare([p for p in batch for _ in range(6)], params)
    assert drafted > 0 and accepted > 0


def test_n_greater_than_one(engines: Engines) -> None:
    params = SamplingParams(
        n=3, temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, frequency_penalty=0.2
    )
    drafted, accepted = engines.compare(prompts()[:3], params)
    assert drafted > 0 and accepted > 0


@pytest.fixture(scope="module", params=["ngram_llama", "mtp_v3"])
def byte_engines(request, tmp_path_factory) -> Engines:
    """The same pairs on models with a byte tokenizer, which llguidance reads (structured outputs)."""
    if request.param == "ngram_llama":
        return Engines(build_tiny("llama", tmp_path_factory.mktemp("byte_llama"), tokenizer="bytes"), NGRAM)
    plain = build_tiny("deepseek_v3", tmp_path_factory.mktemp("byte_v3"), tokenizer="bytes")
    return Engines(add_mtp_layer(plain, tmp_path_factory.mktemp("byte_v3_echo"), echo=True), MTP)


GRAMMARS = {
    # The prompts repeat "abc" and "ab12": the regex takes some of the drafts they propose and rejects others.
    "regex": StructuredOutputsParams(regex=r"(ab|ba|c)+1?[0-9a-c]{0,30}"),
    "choice": StructuredOutputsParams(choice=["abcabcabcab", "abab12ab12", "cabcab1"]),
    "json": StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    ),
}


@pytest.mark.parametrize("kind", GRAMMARS)
def test_grammars_mask_each_draft_row_with_the_state_after_the_drafts_before_it(
    byte_engines, kind: str
) -> None:
    batch = ["abcabcabcabcabc", "ab12ab12ab12ab12", '{"a": "abcabc"} {"a": "ab']
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=GRAMMARS[kind], logprobs=1)
    drafted, accepted = byte_engines.compare(batch, params)
    assert drafted > 0


def test_sampled_grammar_requests_take_drafts_and_hold_their_grammar(byte_engines) -> None:
    """Rejection sampling against masked rows: every output still matches the regex, and seeded requests repeat."""
    pattern = r"(ab|ba|c)+1?[0-9a-c]{0,30}"
    params = [
        SamplingParams(
            temperature=0.8, seed=s, max_tokens=24, structured_outputs=GRAMMARS["regex"], logprobs=1
        )
        for s in range(6)
    ]
    batch = ["abcabcabcabcabc", "ab12ab12ab12ab12"] * 3
    llm = byte_engines.spec
    before = llm.stats()["num_draft_tokens"]
    first = llm.generate(batch, params, use_tqdm=False)
    again = llm.generate(batch, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        out = a.outputs[0]
        assert re.fullmatch(pattern, out.text) and out.token_ids == b.outputs[0].token_ids
        assert len(out.logprobs) == len(out.token_ids)
        assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs, strict=True))
    stats = llm.stats()
    assert stats["num_draft_tokens"] > before and stats["kv_blocks_used"] == 0


def test_features_under_chunking_preemption_and_prefix_hits(llama) -> None:
    """A 12-token step chunks the prompts and caps the drafts; 24 blocks of 4 tokens cannot hold every request,
    so requests are preempted and recomputed (their penalties' counts and min_tokens read the kept outputs)."""
    engines = Engines(llama, NGRAM, max_num_batched_tokens=12, num_kv_blocks=24, max_model_len=64)
    params = [
        SamplingParams(temperature=0, max_tokens=20, **{"ignore_eos": True, **FEATURES[f]})
        for f in ("logprobs", "frequency", "all_penalties", "min_tokens_6")
    ]
    batch = prompts()[1:5]
    for _ in range(2):  # the second run hits the prompts' cached blocks
        drafted, accepted = engines.compare(batch, params)
        assert drafted > 0 and accepted > 0
    stats = engines.spec.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
