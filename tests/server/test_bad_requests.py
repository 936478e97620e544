"""Every client mistake is a 4xx with an OpenAI error body, and the server keeps serving after each."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import fresh_stats, live_server, make_engine

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = make_engine(tiny_model)
    for live, _ in live_server(engine, api_keys=(KEY, "sk-other"), served_model_name="tiny"):
        with httpx.Client(base_url=live.url, timeout=30) as client:
            yield client, engine
    engine.shutdown()


def good_completion(client: httpx.Client) -> None:
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "w4 w5", "max_tokens": 2}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


LONG_PROMPT = " ".join(["w7"] * 300)  # 300 tokens > max_model_len 256
CHAT = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BAD_BODIES = [
    ("malformed json", "/v1/completions", b'{"prompt": "w1", ', 400, None),
    ("not an object", "/v1/completions", b'["w1"]', 400, None),
    ("NaN is not JSON", "/v1/completions", b'{"prompt": "w1", "temperature": NaN}', 400, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "w1 \xff\xfe"}', 400, None),
    ("prompt wrong type", "/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (
        "max_tokens string",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": "5"}).encode(),
        400,
        "max_tokens",
    ),
    (
        "temperature list",
        "/v1/completions",
        json.dumps({"prompt": "w1", "temperature": [1]}).encode(),
        400,
        "temperature",
    ),
    (
        "stream not bool",
        "/v1/chat/completions",
        json.dumps({"messages": [], "stream": "yes"}).encode(),
        400,
        "stream",
    ),
    ("messages not list", "/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "robot", "content": "w1"}]}).encode(),
        400,
        "messages",
    ),
    ("missing prompt", "/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (
        "unknown model",
        "/v1/completions",
        json.dumps({"model": "gpt-9", "prompt": "w1"}).encode(),
        404,
        "model",
    ),
    (
        "unknown model chat",
        "/v1/chat/completions",
        json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "w1"}]}).encode(),
        404,
        "model",
    ),
    (
        "empty messages",
        "/v1/chat/completions",
        json.dumps({"messages": [], "max_tokens": 2}).encode(),
        400,
        "messages",
    ),
    ("empty prompt", "/v1/completions", json.dumps({"prompt": "", "max_tokens": 2}).encode(), 400, "prompt"),
    (
        "empty prompt list",
        "/v1/completions",
        json.dumps({"prompt": [], "max_tokens": 2}).encode(),
        400,
        "prompt",
    ),
    ("token id out of range", "/v1/completions", json.dumps({"prompt": [1, 99999]}).encode(), 400, "prompt"),
    (
        "prompt past max_model_len",
        "/v1/completions",
        json.dumps({"prompt": LONG_PROMPT}).encode(),
        400,
        "prompt",
    ),
    (
        "chat past max_model_len",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": LONG_PROMPT}]}).encode(),
        400,
        "messages",
    ),
    (
        "max_tokens 0",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": 0}).encode(),
        400,
        "max_tokens",
    ),
    (
        "max_tokens 1e9",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": 10**9}).encode(),
        400,
        "max_tokens",
    ),
    (
        "chat max_tokens 1e9",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 10**9}).encode(),
        400,
        "max_tokens",
    ),
    (
        "chat max_completion_tokens 0",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 0}).encode(),
        400,
        "max_completion_tokens",
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": -1}).encode(),
        400,
        "max_tokens",
    ),
    ("n 0", "/v1/completions", json.dumps({"prompt": "w1", "n": 0}).encode(), 400, "n"),
    ("n too many", "/v1/completions", json.dumps({"prompt": "w1", "n": 1000}).encode(), 400, "n"),
    (
        "temperature negative",
        "/v1/completions",
        json.dumps({"prompt": "w1", "temperature": -1}).encode(),
        400,
        "temperature",
    ),
    ("top_p 0", "/v1/completions", json.dumps({"prompt": "w1", "top_p": 0}).encode(), 400, "top_p"),
    ("empty stop", "/v1/completions", json.dumps({"prompt": "w1", "stop": [""]}).encode(), 400, "stop"),
    (
        "logprobs 21",
        "/v1/completions",
        json.dumps({"prompt": "w1", "logprobs": 21}).encode(),
        400,
        "logprobs",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}).encode(),
        400,
        "top_logprobs",
    ),
    ("seed past int64", "/v1/completions", json.dumps({"prompt": "w1", "seed": 2**64}).encode(), 400, "seed"),
    (
        "seed + n past int64",
        "/v1/completions",
        json.dumps({"prompt": "w1", "seed": 2**63 - 1, "n": 2}).encode(),
        400,
        "seed",
    ),
    (
        "max_tokens 0 without echo",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": 0, "echo": False}).encode(),
        400,
        "max_tokens",
    ),
    # tool_choice "auto", the default with tools, needs a tool parser, which this server was not given
    ("tools", "/v1/chat/completions", json.dumps({**CHAT, "tools": [TOOL]}).encode(), 400, "tool_choice"),
    (
        "tool with a bad name",
        "/v1/chat/completions",
        json.dumps({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}).encode(),
        400,
        "tools[0].function.name",
    ),
    (
        "tool_choice required",
        "/v1/chat/completions",
        json.dumps({**CHAT, "tool_choice": "required"}).encode(),
        400,
        "tool_choice",
    ),
    (
        "functions",
        "/v1/chat/completions",
        json.dumps({**CHAT, "functions": [TOOL]}).encode(),
        400,
        "functions",
    ),
    (
        "audio modality",
        "/v1/chat/completions",
        json.dumps({**CHAT, "modalities": ["text", "audio"]}).encode(),
        400,
        "modalities",
    ),
    ("store true", "/v1/chat/completions", json.dumps({**CHAT, "store": True}).encode(), 400, "store"),
    (
        "reasoning_effort",
        "/v1/chat/completions",
        json.dumps({**CHAT, "reasoning_effort": "high"}).encode(),
        400,
        "reasoning_effort",
    ),
    ("suffix", "/v1/completions", json.dumps({"prompt": "w1", "suffix": "w2"}).encode(), 400, "suffix"),
    ("best_of 3", "/v1/completions", json.dumps({"prompt": "w1", "best_of": 3}).encode(), 400, "best_of"),
    (
        "unknown field",
        "/v1/completions",
        json.dumps({"prompt": "w1", "frobnicate": [1]}).encode(),
        400,
        "frobnicate",
    ),
    (
        "assistant tool_calls",
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}
        ).encode(),
        400,
        "messages",
    ),
    (
        "presence_penalty 3",
        "/v1/completions",
        json.dumps({"prompt": "w1", "presence_penalty": 3}).encode(),
        400,
        "presence_penalty",
    ),
    (
        "frequency_penalty -2.5",
        "/v1/chat/completions",
        json.dumps({**CHAT, "frequency_penalty": -2.5}).encode(),
        400,
        "frequency_penalty",
    ),
    (
        "repetition_penalty 0",
        "/v1/completions",
        json.dumps({"prompt": "w1", "repetition_penalty": 0}).encode(),
        400,
        "repetition_penalty",
    ),
    (
        "logit_bias 200",
        "/v1/completions",
        json.dumps({"prompt": "w1", "logit_bias": {"5": 200}}).encode(),
        400,
        "logit_bias",
    ),
    (
        "logit_bias not a token id",
        "/v1/completions",
        json.dumps({"prompt": "w1", "logit_bias": {"w5": 1}}).encode(),
        400,
        "logit_bias",
    ),
    (
        "logit_bias past the vocabulary",
        "/v1/completions",
        json.dumps({"prompt": "w1", "logit_bias": {"99999": 1}}).encode(),
        400,
        "logit_bias",
    ),
    (
        "min_tokens over max_tokens",
        "/v1/completions",
        json.dumps({"prompt": "w1", "max_tokens": 2, "min_tokens": 5}).encode(),
        400,
        "min_tokens",
    ),
    (
        "response_format unknown type",
        "/v1/chat/completions",
        json.dumps({**CHAT, "response_format": {"type": "yaml"}}).encode(),
        400,
        "response_format",
    ),
    (
        "json_schema without schema",
        "/v1/chat/completions",
        json.dumps(
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
        ).encode(),
        400,
        "response_format",
    ),
    (
        "json_schema with a tokenizer llguidance cannot read",
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                },
            }
        ).encode(),
        400,
        "response_format",
    ),
    (
        "two constraints",
        "/v1/completions",
        json.dumps(
            {"prompt": "w1", "response_format": {"type": "json_object"}, "guided_regex": "w1"}
        ).encode(),
        400,
        "guided_regex",
    ),
    (
        "image content",
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        ).encode(),
        400,
        "messages",
    ),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_body_is_a_4xx_openai_error_and_the_server_keeps_serving(server, name, path, body, status, param):
    client, _ = server
    assert_openai_error(client.post(path, content=body, headers=JSON), status, param)
    good_completion(client)


def test_fields_that_cannot_change_the_output_and_nulls_are_accepted(server):
    client, _ = server
    body = {
        "prompt": "w1",
        "max_tokens": 2,
        "user": "someone",
        "metadata": {"any": "thing"},
        "suffix": None,
        "tools": None,
        "n": None,
        "stream": None,
        "echo": None,
        "logprobs": None,
        "temperature": None,
        "best_of": 1,
    }
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200, body
    chat = {
        **CHAT,
        "logprobs": None,
        "n": None,
        "stream": None,
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "response_format": {"type": "text"},
    }
    assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 200, chat


def test_ten_megabyte_body_is_413(server):
    client, _ = server
    body = json.dumps({"prompt": "w1 " * (10 * 1024 * 1024 // 3)}).encode()
    assert len(body) > 10 * 1024 * 1024
    assert_openai_error(client.post("/v1/completions", content=body, headers=JSON), 413)
    good_completion(client)


def test_chunked_body_past_the_limit_is_413(server):
    client, _ = server

    def chunks():
        for _ in range(6):
            yield b" " * (1024 * 1024)

    assert_openai_error(client.post("/v1/completions", content=chunks(), headers=JSON), 413)
    good_completion(client)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic c2stdGVzdC1rZXk="},
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
def test_missing_or_wrong_api_key_is_401(server, headers):
    client, _ = server
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ):
        r = client.request(method, path, json={"prompt": "w1"}, headers=headers)
        error = assert_openai_error(r, 401)
        assert error["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-other"}).status_code == 200
    assert client.get("/health").status_code == 200  # ops endpoints stay open
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_not_declared_as_json_is_415(server, path, content_type):
    client, _ = server
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    error = assert_openai_error(client.post(path, content=b'{"prompt": "w1"}', headers=headers), 415)
    assert "application/json" in error["message"] and error["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", 'Application/JSON;charset="UTF-8"']
)
def test_json_with_a_utf8_charset_is_accepted(server, content_type):
    client, _ = server
    body = json.dumps({"model": "tiny", "prompt": "w4 w5", "max_tokens": 2}).encode()
    r = client.post("/v1/completions", content=body, headers={**AUTH, "Content-Type": content_type})
    assert r.status_code == 200, r.text


def test_openapi_schema_is_behind_the_key_and_no_docs_pages(server):
    client, _ = server
    assert_openai_error(client.get("/openapi.json"), 401)
    r = client.get("/openapi.json", headers=AUTH)
    assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
    for path in ("/docs", "/redoc"):
        assert_openai_error(client.get(path), 404)


def test_unknown_route_and_wrong_method_are_openai_errors(server):
    client, _ = server
    assert_openai_error(client.get("/v1/nothing", headers=AUTH), 404)
    assert_openai_error(client.get("/v1/completions", headers=AUTH), 405)


def test_no_chat_template_is_400(tiny_model):
    engine = make_engine(tiny_model)
    engine.call(lambda e: setattr(e.tokenizer, "chat_template", None)).result()
    try:
        for live, _ in live_server(engine):
            r = httpx.post(
                f"{live.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]}
            )
            assert "chat template" in assert_openai_error(r, 400, "messages")["message"]
    finally:
        engine.shutdown()


def test_no_blocks_leaked_after_all_that(server):
    client, engine = server
    good_completion(client)
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    assert engine.num_in_flight == 0
