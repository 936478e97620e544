"""Penalties, logit_bias, min_tokens and structured outputs change the output as vLLM and OpenAI define them.

Greedy outputs are checked token by token against transformers' logits for the same prefix, processed by the
definition (teacher forcing), so the test holds for any random model."""

import json
import re

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.testing.tiny_models import BYTE_EOS, build_tiny, load_reference

PROMPT = [5, 9, 9, 17, 5, 33, 2, 9]
OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)


def definition(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    return out


def assert_greedy_follows_definition(model_dir, llm: LLM, params: SamplingParams) -> list[int]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    ref = load_reference(model_dir)
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + out])).logits[0].float()
    for i, token in enumerate(out):
        expected = definition(logits[len(PROMPT) - 1 + i], PROMPT, out[:i], params).argmax().item()
        assert token == expected, (i, out)
    return out


@pytest.mark.parametrize(
    "fields",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=-2.0, frequency_penalty=0.5),
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(logit_bias={7: 4.0, 11: -100.0}),
    ],
    ids=["presence", "frequency", "negative presence", "repetition", "repetition < 1", "logit_bias"],
)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_and_bias_follow_their_definition(llama, fields, async_scheduling):
    llm = LLM(str(llama), async_scheduling=async_scheduling, **OPTIONS)
    plain = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **fields)
    out = assert_greedy_follows_definition(llama, llm, params)
    assert out != plain[0].outputs[0].token_ids  # the field changed the output


def test_logit_bias_of_100_forces_a_token_and_minus_100_bans_it(llama):
    llm = LLM(str(llama), **OPTIONS)
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, logit_bias={42: 100})
    assert (
        llm.generate([{"prompt_token_ids": PROMPT}], forced, use_tqdm=False)[0].outputs[0].token_ids
        == [42] * 10
    )
    greedy = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    banned = set(greedy[0].outputs[0].token_ids)
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, logit_bias=dict.fromkeys(banned, -100)
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert not banned & set(out)


def test_min_tokens_holds_eos_and_stop_strings_back(llama):
    llm = LLM(str(llama), **OPTIONS)
    eos = 1  # the tiny word tokenizer's EOS, "w1"
    eager = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})
    assert llm.generate([{"prompt_token_ids": PROMPT}], eager)[0].outputs[0].token_ids == [eos]
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100}, min_tokens=5)
    out = llm.generate([{"prompt_token_ids": PROMPT}], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    # A stop string that shows up in the first tokens does not end the output before min_tokens.
    greedy = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    first_word = greedy[0].outputs[0].text.split()[0]
    stopped = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[first_word])
    assert (
        llm.generate([{"prompt_token_ids": PROMPT}], stopped)[0].outputs[0].token_ids
        == greedy[0].outputs[0].token_ids[:1]
    )
    late = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[first_word], min_tokens=4)
    assert len(llm.generate([{"prompt_token_ids": PROMPT}], late)[0].outputs[0].token_ids) >= 4


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("byte_llama"), tokenizer="bytes")


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(3))
def test_structured_outputs_hold_for_a_random_model(byte_llama, seed):
    llm = LLM(str(byte_llama), **OPTIONS)
    cases = [
        (
            StructuredOutputsParams(json=SCHEMA),
            lambda t: set(json.loads(t)) == {"ok", "kind"} and json.loads(t)["kind"] in ("cat", "dog"),
        ),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (
            StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"),
            lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) is not None,
        ),
        (
            StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
            lambda t: t in ("alpha", "beta", "gamma"),
        ),
    ]
    for constraint, valid in cases[:1] + cases[2:]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=constraint)
        out = llm.generate(["Answer: "], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == BYTE_EOS, (constraint, out.text)
        assert valid(out.text), (constraint, out.text)
    # Any JSON object: a random model may write a long one; what it writes must still be a JSON prefix.
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=cases[1][0])
    out = llm.generate(["Answer: "], params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert cases[1][1](out.text)
    assert llm.stats()["kv_blocks_used"] == 0


def test_unconstrained_random_model_is_not_json_by_chance(byte_llama):
    llm = LLM(str(byte_llama), **OPTIONS)
    out = llm.generate(["Answer: "], SamplingParams(temperature=1.0, seed=0, max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(out[0].outputs[0].text)


def test_a_schema_that_does_not_compile_is_a_clear_error(byte_llama):
    llm = LLM(str(byte_llama), **OPTIONS)
    bad = [
        (
            dict(json={"type": "nonsense"}),
            "structured_outputs.json: the JSON schema cannot be compiled: .*nonsense",
        ),
        (dict(regex="(abc"), "structured_outputs.regex: the regex cannot be compiled: .*unclosed group"),
        (dict(grammar="start: foo"), 'structured_outputs.grammar: the grammar cannot be compiled: .*"foo"'),
        (dict(choice=[str(i) for i in range(100_000)]), "structured_outputs.choice: 100000 entries is more"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message) as info:
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
        assert type(info.value) is ValueError and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_waiting"] == 0
