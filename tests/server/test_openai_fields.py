"""Every OpenAI sampling field through real clients (the `openai` package and LangChain's ChatOpenAI): the ones
implemented change the output as specified and give the offline API's tokens; the others are a 400 naming them."""

from __future__ import annotations

import json
import math
import time

import openai
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.testing.tiny_models import build_tiny
from tests.server.conftest import live_server, make_engine

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
PROMPT = "The sky is"
CHAT = [{"role": "user", "content": "Say something."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer (which llguidance reads) and a chat template."""
    path = build_tiny("llama", tmp_path_factory.mktemp("fields_llama"), tokenizer="bytes")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model):
    engine = make_engine(model, **OPTIONS)
    yield from live_server(engine, served_model_name="tiny")
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    live, _ = server
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model) -> LLM:
    return LLM(str(model), **OPTIONS)


# field -> (how the openai client sends it, SamplingParams fields)
IMPLEMENTED = {
    "presence_penalty": ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    "frequency_penalty": ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    "logit_bias": ({"logit_bias": {"101": 6.0, "32": -100}}, {"logit_bias": {101: 6.0, 32: -100}}),
    "repetition_penalty": ({"extra_body": {"repetition_penalty": 1.7}}, {"repetition_penalty": 1.7}),
    "min_tokens": (
        {"extra_body": {"min_tokens": 12}, "logit_bias": {"256": 100}},
        {"min_tokens": 12, "logit_bias": {256: 100}},
    ),
    "top_k": (
        {"temperature": 1.0, "seed": 3, "extra_body": {"top_k": 2}},
        {"temperature": 1.0, "seed": 3, "top_k": 2},
    ),
    "min_p": (
        {"temperature": 1.0, "seed": 3, "extra_body": {"min_p": 0.3}},
        {"temperature": 1.0, "seed": 3, "min_p": 0.3},
    ),
}


@pytest.mark.parametrize("field", IMPLEMENTED)
def test_implemented_field_changes_the_output_like_the_offline_api(client, offline, field):
    sent, params = IMPLEMENTED[field]
    text_plain = (
        client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16).choices[0].text
    )
    kwargs = {"temperature": 0, **{k: v for k, v in sent.items() if k != "extra_body"}}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, extra_body=sent.get("extra_body"), **kwargs
    )
    want = offline.generate(
        PROMPT, SamplingParams(**{"temperature": 0, "max_tokens": 16, **params}), use_tqdm=False
    )[0]
    assert out.choices[0].text == want.outputs[0].text
    if field == "min_tokens":  # EOS is forced, so without min_tokens the text is empty
        assert len(want.outputs[0].token_ids) == 13 and out.choices[0].finish_reason == "stop"
    elif "seed" not in kwargs:
        assert out.choices[0].text != text_plain, field
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=16, extra_body=sent.get("extra_body"), **kwargs
    )
    chat_want = offline.chat(
        CHAT, SamplingParams(**{"temperature": 0, "max_tokens": 16, **params}), use_tqdm=False
    )[0]
    assert chat.choices[0].message.content == chat_want.outputs[0].text


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_response_format_gives_json(client, offline, kind):
    fmt = {"type": "json_object"}
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=80, temperature=0, response_format=fmt
    )
    constraint = (
        StructuredOutputsParams(json_object=True)
        if kind == "json_object"
        else StructuredOutputsParams(json=SCHEMA)
    )
    want = offline.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint), use_tqdm=False
    )
    text = out.choices[0].message.content
    assert text == want[0].outputs[0].text
    assert text.startswith("{")
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0)
    assert plain.choices[0].message.content != text


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "low"),
        ("store", True),
        ("web_search_options", {}),
    ],
)
def test_unsupported_chat_field_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **{field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_unsupported_completion_fields_are_400s(client):
    for field, value in (("suffix", "end"), ("best_of", 3)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **{field: value})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"nonsense_option": 1}
        )
    assert e.value.body["param"] == "nonsense_option"


def test_created_is_the_request_time(client):
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    time.sleep(1.1)
    second = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert second.created > first.created
    assert abs(second.created - time.time()) < 5


def test_echo_returns_the_prompt_and_its_logprobs(client, offline):
    want = offline.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    )[0]
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = out.choices[0]
    assert choice.text == PROMPT + want.outputs[0].text
    lp = choice.logprobs
    n = len(want.prompt_token_ids)
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert math.isclose(
            lp.token_logprobs[i], want.prompt_logprobs[i][want.prompt_token_ids[i]].logprob, abs_tol=1e-5
        )
    generated = want.outputs[0]
    for j, token in enumerate(generated.token_ids):
        assert math.isclose(lp.token_logprobs[n + j], generated.logprobs[j][token].logprob, abs_tol=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    # max_tokens 0: the prompt alone, scored (what lm-eval's loglikelihood requests need).
    only = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    assert only.choices[0].text == PROMPT and len(only.choices[0].logprobs.tokens) == n
    assert only.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:n]
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == n


def test_echo_streamed_equals_whole(client):
    kwargs = dict(model="tiny", prompt=[PROMPT, "A cat"], max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kwargs)
    texts, logprobs = {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for c in whole.choices:
        assert texts[c.index] == c.text and logprobs[c.index] == c.logprobs.token_logprobs


def test_langchain_chat_openai(server, offline):
    langchain_openai = pytest.importorskip("langchain_openai")
    live, _ = server
    kwargs = dict(model="tiny", base_url=f"{live.url}/v1", api_key="unused", max_retries=0, max_tokens=16)
    llm = langchain_openai.ChatOpenAI(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, **kwargs)
    want = offline.chat(
        CHAT,
        SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5),
        use_tqdm=False,
    )[0]
    assert llm.invoke(CHAT[0]["content"]).content == want.outputs[0].text
    assert "".join(chunk.content for chunk in llm.stream(CHAT[0]["content"])) == want.outputs[0].text
    e = offline.get_tokenizer().encode("e", add_special_tokens=False)[0]
    biased = langchain_openai.ChatOpenAI(temperature=0, logit_bias={e: 100}, **kwargs)
    assert biased.invoke(CHAT[0]["content"]).content == "e" * 16
    structured = langchain_openai.ChatOpenAI(temperature=0, **{**kwargs, "max_tokens": 80})
    answer = structured.with_structured_output(
        {"title": "answer", "description": "an answer", **SCHEMA}, method="json_schema"
    ).invoke(CHAT[0]["content"])
    assert set(answer) == {"name", "ok"}
    with pytest.raises(openai.BadRequestError) as e:
        structured.bind_tools(
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        ).invoke("hi")
    assert e.value.body["param"] == "tool_choice"  # "auto" needs a tool parser; this server has none


def test_continuous_usage_stats_puts_usage_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, stream=True, stream_options=options
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 4
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=3, stream=True, stream_options=options
        )
    )
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 3
