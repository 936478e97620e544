"""The real `openai` client against a live server: streamed text == whole text == the offline API's output."""

from __future__ import annotations

import math

import openai
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.async_engine import AsyncEngine
from tests.server.conftest import ENGINE_OPTIONS, live_server, make_engine

PROMPTS = ["w5 w6 w7", "w100 w3 w42 w9 w17", "w200"]
CHAT = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = make_engine(tiny_model)
    yield from live_server(engine, served_model_name="tiny")
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    live, _ = server
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(str(tiny_model), **ENGINE_OPTIONS)


def streamed_completion(client: openai.OpenAI, **kwargs: object) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def streamed_chat(client: openai.OpenAI, **kwargs: object) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_lists_the_served_name_and_the_startup_report(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["mlaserve"] == {"test": True}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_equals_whole_equals_offline(client, offline, prompt):
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text, finish, usage = streamed_completion(
        client, model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].text == want.outputs[0].text
    assert text == want.outputs[0].text
    assert whole.choices[0].finish_reason == finish == want.outputs[0].finish_reason
    assert whole.usage.prompt_tokens == usage.prompt_tokens == len(want.prompt_token_ids)
    assert whole.usage.completion_tokens == usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_streamed_equals_whole_equals_offline(client, offline):
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    text, finish, usage = streamed_chat(
        client,
        model="tiny",
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text == want.outputs[0].text
    assert whole.choices[0].finish_reason == finish
    assert usage.total_tokens == whole.usage.total_tokens


def test_prompt_lists_token_ids_and_n(client, offline):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [want[0], want[0], want[1], want[1]]
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == want[0]


def test_seeded_sampling_repeats_and_n_choices_differ(client):
    kwargs = dict(model="tiny", prompt="w7 w8", max_tokens=8, temperature=1.0, seed=1234, n=3)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    second = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == second
    assert len(set(first)) > 1  # seed+i per choice


def test_stop_string_ends_the_text_in_both_modes(client, offline):
    full = offline.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    words = full.outputs[0].text.split(" ")
    cut = next(i for i in range(1, len(words)) if words[i] not in words[:i])  # a word's first appearance
    stop = " " + words[cut]
    whole = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0, stop=stop)
    text, finish, _ = streamed_completion(
        client, model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0, stop=[stop]
    )
    assert whole.choices[0].text == text == " ".join(words[:cut])
    assert whole.choices[0].finish_reason == finish == "stop"


def test_completion_logprobs(client, offline):
    want = offline.generate("w9 w8", SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[
        0
    ]
    out = client.completions.create(model="tiny", prompt="w9 w8", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    tokens = offline.get_tokenizer().convert_ids_to_tokens(want.outputs[0].token_ids)
    assert lp.tokens == tokens
    for got, expect, token_id in zip(lp.token_logprobs, want.outputs[0].logprobs, want.outputs[0].token_ids):
        assert math.isclose(got, expect[token_id].logprob, abs_tol=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_whole(client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(whole) == 4
    assert all(
        len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in whole
    )
    assert all(
        t.logprob == t.top_logprobs[0].logprob for t in whole
    )  # greedy: the sampled token is the top one
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    # The second request reads the first one's prompt from the prefix cache: the same numbers up to rounding.
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(streamed, whole, strict=True))


def test_client_errors_come_back_as_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="w1", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
    assert e.value.body["param"] == "messages"


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 (its real chat template): the offline answer first, then the same engine behind the server."""
    # No prefix caching: the server's run must not start from blocks the offline run left behind.
    llm = LLM(
        None, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64, enable_prefix_caching=False
    )
    return llm, llm.engine


@pytest.mark.slow
def test_smollm2_chat_template_over_http(smollm2):
    llm, engine = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0].text
    async_engine = AsyncEngine(engine)
    try:
        for live, _ in live_server(async_engine, served_model_name="smollm2"):
            client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
            whole = client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=10, temperature=0
            )
            text, _, _ = streamed_chat(
                client, model="smollm2", messages=messages, max_tokens=10, temperature=0
            )
    finally:
        async_engine.shutdown()
    assert want.strip()
    assert whole.choices[0].message.content == text == want
