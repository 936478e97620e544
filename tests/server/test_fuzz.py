"""Property-based fuzzing of both generation endpoints: no 5xx, OpenAI error bodies, no leaked KV blocks.

Bodies mix valid values, wrong types and out-of-range values per field, unknown fields and raw bytes.
max_tokens is always small (or invalid), so >= 500 requests finish in well under a minute.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlaserve.config.server_settings import ServerSettings
from mlaserve.server.app import build_app
from tests.server.conftest import fresh_stats, make_engine

pytestmark = pytest.mark.slow

EXAMPLES_PER_ENDPOINT = 260

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.just(10**9),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    # Any code point, lone surrogates included: JSON's \\uXXXX escapes can spell them, and a 400 (never a 500)
    # must name the field that holds one.
    st.text(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=8),
    st.lists(st.integers(-2, 300), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
words = st.lists(st.integers(0, 255).map(lambda i: f"w{i}"), min_size=1, max_size=12).map(" ".join)
token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=12)
max_tokens = st.integers(1, 4)

# Valid values, field by field; a body is valid values plus at most one field replaced by junk.
sampling_fields = {
    "model": st.just("tiny"),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "n": st.integers(1, 3),
    "stop": st.one_of(words, st.lists(words, max_size=3)),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": junk,  # ignored whatever it is
}
completion_fields = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            words, st.lists(words, min_size=1, max_size=3), token_ids, st.lists(token_ids, max_size=2)
        ),
        "max_tokens": max_tokens,
    },
    optional={**sampling_fields, "logprobs": st.integers(0, 5), "echo": st.just(False)},
)
content = st.one_of(
    words, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), max_size=2)
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": content},
    optional={"name": st.text(max_size=5)},
)
chat_fields = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": max_tokens},
    optional={
        **sampling_fields,
        "max_completion_tokens": max_tokens,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
    },
)
COMPLETION_KEYS = ["prompt", "max_tokens", "logprobs", "echo", *sampling_fields]
CHAT_KEYS = ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", *sampling_fields]


def bodies(fields: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """Valid bodies, some with one field broken or an unknown field, and some raw bytes."""
    broken = st.one_of(st.just({}), st.tuples(st.sampled_from(keys), junk).map(lambda kv: {kv[0]: kv[1]}))
    unknown = st.dictionaries(
        st.text(min_size=1, max_size=6).filter(lambda k: k not in keys), junk, max_size=2
    )
    as_json = st.tuples(fields, broken, unknown).map(lambda t: json.dumps({**t[2], **t[0], **t[1]}).encode())
    return st.one_of(as_json, as_json, as_json, as_json, st.binary(max_size=40))


@pytest.fixture(scope="module")
def fuzz_client(tiny_model):
    engine = make_engine(tiny_model)
    app = build_app(engine, ServerSettings(served_model_name="tiny"), {})
    counter = {"requests": 0}
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, engine, counter
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    assert engine.num_in_flight == 0
    engine.shutdown()


def check(client: TestClient, counter: dict, path: str, body: bytes) -> None:
    counter["requests"] += 1
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    counter[(path, r.status_code)] = counter.get((path, r.status_code), 0) + 1
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", r.text
        assert '"error"' not in r.text, r.text
    else:
        assert r.json()["choices"], r.text


# derandomize: CI explores the same examples every run, so a red CI is a regression, not a new draw; run with
# `--hypothesis-seed=N` after removing it locally to explore further.
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_ENDPOINT,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ_SETTINGS
@given(body=bodies(completion_fields, COMPLETION_KEYS))
def test_fuzz_completions(fuzz_client, body):
    client, _, counter = fuzz_client
    check(client, counter, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=bodies(chat_fields, CHAT_KEYS))
def test_fuzz_chat_completions(fuzz_client, body):
    client, _, counter = fuzz_client
    check(client, counter, "/v1/chat/completions", body)


def test_fuzz_ran_enough_requests_and_leaked_nothing(fuzz_client):
    client, engine, counter = fuzz_client
    if counter["requests"] == 0:
        pytest.skip("run together with the two fuzz tests above")
    assert counter["requests"] >= 2 * EXAMPLES_PER_ENDPOINT >= 500
    for path in ("/v1/completions", "/v1/chat/completions"):  # the fuzz reached generation, and errors
        assert counter.get((path, 200), 0) > EXAMPLES_PER_ENDPOINT // 4
        assert counter.get((path, 400), 0) > EXAMPLES_PER_ENDPOINT // 10
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    assert engine.num_in_flight == 0
    assert client.get("/health").status_code == 200
