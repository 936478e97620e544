"""An output constraint that cannot be compiled is a 400 naming the request's own field, decided at intake; no
error body, 4xx or 5xx, carries a backtrace or a path of the server's machine."""

from __future__ import annotations

import time

import httpx
import pytest

from mlaserve.sampling.grammar_error import compile_error
from mlaserve.sampling.structured_output import MAX_CHOICE_ENTRIES, choice_regex
from mlaserve.testing.tiny_models import build_tiny
from tests.server.conftest import fresh_stats, live_server, make_engine

HUGE_CHOICE = [f"option {i}" for i in range(100_000)]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "objectx"}}}
# What an error body must never hold: a backtrace, a source location, a path of the server's machine.
LEAKS = ("Traceback", "panic", "backtrace", "/home", "/usr", "/root", "/tmp", ".py:", ".rs:")


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama with a byte-level tokenizer: one llguidance can read (the word-level one it cannot)."""
    return build_tiny("llama", tmp_path_factory.mktemp("grammar_llama"), tokenizer="bytes")


@pytest.fixture(scope="module")
def server(byte_model):
    engine = make_engine(byte_model)
    for live, _ in live_server(engine, served_model_name="tiny"):
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield client, engine
    engine.shutdown()


def completion(client: httpx.Client, **constraint: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 0, **constraint}
    return client.post("/v1/completions", json=body)


def assert_no_leak(body: object) -> None:
    text = str(body)
    for mark in LEAKS:
        assert mark not in text, (mark, text[:500])


# (id, request fields, the field the error must name, words the reason must hold)
UNCOMPILABLE = [
    ("guided_choice 100k", {"guided_choice": HUGE_CHOICE}, "guided_choice", "100000 entries"),
    (
        "structured_outputs.choice 100k",
        {"structured_outputs": {"choice": HUGE_CHOICE}},
        "structured_outputs.choice",
        "100000 entries",
    ),
    (
        "response_format bad schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
        "response_format",
        "JSON schema cannot be compiled",
    ),
    ("guided_json bad schema", {"guided_json": BAD_SCHEMA}, "guided_json", "objectx"),
    (
        "structured_outputs.json dangling ref",
        {"structured_outputs": {"json": {"$ref": "#/definitions/nowhere"}}},
        "structured_outputs.json",
        "JSON schema cannot be compiled",
    ),
    ("guided_regex unclosed group", {"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    (
        "structured_outputs.regex bad range",
        {"structured_outputs": {"regex": "[z-a]"}},
        "structured_outputs.regex",
        "regex cannot be compiled",
    ),
    (
        "guided_grammar unknown rule",
        {"guided_grammar": "start: foo"},
        "guided_grammar",
        'unknown name: "foo"',
    ),
    (
        "structured_outputs.grammar bad regex",
        {"structured_outputs": {"grammar": "start: /[/"}},
        "structured_outputs.grammar",
        "unclosed character class",
    ),
]


@pytest.mark.parametrize("name,fields,field,reason", UNCOMPILABLE, ids=[c[0] for c in UNCOMPILABLE])
def test_an_uncompilable_constraint_is_a_400_naming_the_field(server, name, fields, field, reason):
    client, engine = server
    started = time.monotonic()
    r = completion(client, **fields)
    elapsed = time.monotonic() - started
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert error["message"].startswith(f"{field}: ") and reason in error["message"], error
    assert "\n" not in error["message"]
    assert_no_leak(r.json())
    assert elapsed < 10, f"{name} took {elapsed:.1f} s to refuse"
    # nothing was queued, and the server goes on serving constrained requests
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    ok = completion(client, guided_choice=["yes", "no"])
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no"), ok.text


def test_a_choice_list_past_llguidances_row_limit_is_kept(server):
    """llguidance's own choice grammar fails at the first token once a list passes its max_items_in_row (and the
    engine then drops the constraint); one regex alternation holds every entry to the end."""
    client, _ = server
    choices = [f"c{i}" for i in range(3000)]
    for seed in range(3):
        r = completion(client, guided_choice=choices, temperature=1.0, seed=seed, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in choices, r.json()


def test_choice_regex_escapes_every_metacharacter():
    import re

    choices = ["a.b", "(x)", "1+1", "back\\slash", "[set]", "{2}", "^$", "a|b", "q?", "s*"]
    pattern = re.compile(choice_regex(choices))
    assert all(pattern.fullmatch(c) for c in choices)
    assert not any(pattern.fullmatch(c) for c in ("axb", "x", "11", "a", "b", "set"))


def test_the_cap_is_where_the_list_is_refused(server):
    client, _ = server
    r = completion(client, guided_choice=[f"c{i}" for i in range(MAX_CHOICE_ENTRIES + 1)])
    assert r.status_code == 400 and f"more than the {MAX_CHOICE_ENTRIES}" in r.json()["error"]["message"]


PANIC = (
    "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
    "   0: llguidance::earley::grammar at /root/.cargo/registry/src/grammar.rs:412:9\n"
    '  File "/usr/lib/python3.11/site-packages/llguidance/_lib.py", line 3\n'
)


def test_a_panic_becomes_one_line_without_its_backtrace():
    error = compile_error("grammar", PANIC)
    assert str(error) == (
        "structured_outputs.grammar: the grammar cannot be compiled: it is too large or complex for llguidance "
        "(assertion failed: grammar.symbols.len() < u16::MAX as usize - 10)"
    )
    assert_no_leak(str(error).replace("panic", ""))  # "panic" is not in it either
    assert "panic" not in str(error)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_failure_is_a_500_of_one_line(server, monkeypatch, stream):
    """A grammar that passed intake but failed in the core (as an overflowing one did) is the server's error: its
    body holds the exception's first line, without the backtrace or paths the exception carried."""
    client, engine = server
    compiler = engine.grammar_compiler()

    def fail(params: object) -> None:
        raise ValueError(
            "structured output (choice): the compiler stopped at /home/ops/src/grammar.rs:12:5\n" + PANIC
        )

    monkeypatch.setattr(compiler, "new", fail)
    r = completion(client, guided_choice=["yes", "no"], stream=stream)
    if stream and r.status_code == 200:
        events = [line for line in r.text.splitlines() if line.startswith("data: ") and "error" in line]
        assert events, r.text
        body: object = events
    else:
        assert r.status_code == 500, r.text
        body = r.json()
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_error"
        assert "structured output (choice): the compiler stopped at" in body["error"]["message"]
    assert_no_leak(body)
    monkeypatch.undo()
    assert completion(client, guided_choice=["yes", "no"]).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_the_engine_cannot_keep_enforcing_ends_the_request(server, monkeypatch, caplog, stream):
    """When llguidance stops accepting tokens mid-generation (an internal limit, as a long regex hit), the request
    ends with an error naming why, never a 200 with text past the constraint; the log names the grammar by size
    and hash, never by its text."""
    from mlaserve.sampling.structured_output import Grammar

    client, engine = server
    accept = Grammar.accept
    calls = {"n": 0}

    def accept_twice(self: Grammar, token_id: int) -> bool:
        calls["n"] += 1
        return calls["n"] <= 2 and accept(self, token_id)

    monkeypatch.setattr(Grammar, "accept", accept_twice)
    secret = "a" * 40 + "[0-9]{1,3}"
    with caplog.at_level("WARNING"):
        r = completion(client, guided_regex=secret, max_tokens=12, stream=stream)
    if stream:
        assert r.status_code == 200, r.text
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert any("grammar_not_enforced" in e for e in events), events
        assert not any('"finish_reason":"length"' in e.replace(" ", "") for e in events), events
    else:
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "grammar_not_enforced"
        assert "could not be enforced" in r.json()["error"]["message"]
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "cannot go on" in logged and "sha256" in logged and secret not in logged
    monkeypatch.undo()
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    assert completion(client, guided_choice=["yes", "no"]).status_code == 200
