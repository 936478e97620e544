"""What a hostile client did to the server, replayed: slow bodies, idle and slow-header connections past the cap,
bad Unicode, a huge prompt beside a running stream, keep-alive latency, tiny top_p and n against the limit.

Each test states the bound other clients are served within; none may see a 5xx.
"""

from __future__ import annotations

import http.client
import json
import resource
import socket
import statistics
import threading
import time

import httpx
import pytest

from mlaserve.server import connections
from mlaserve.testing.tiny_models import build_tiny
from tests.server.conftest import live_server, make_engine, metric, serving, wait_for

COMPLETION = {"prompt": "w4 w5 w6", "max_tokens": 4, "temperature": 0}


def raw_connection(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = make_engine(tiny_model)
    yield engine
    engine.shutdown()


@pytest.fixture(params=["httptools", "h11"])
def guarded(engine, request, monkeypatch):
    """A server with small limits: 2 sequences in flight, 16 connections, 1 s for headers, 1.5 s for a body; over
    each of uvicorn's HTTP parsers (h11 is what runs where httptools is not installed)."""
    if request.param == "h11":
        monkeypatch.setattr(connections, "HttpToolsProtocol", None)
    else:
        assert connections.HttpToolsProtocol is not None, "httptools is a dependency"
    settings = dict(
        served_model_name="tiny",
        max_concurrent_requests=2,
        max_connections=16,
        header_timeout_s=1.0,
        body_timeout_s=1.5,
    )
    yield from live_server(engine, **settings)


def test_slow_bodies_hold_no_slot_and_time_out(guarded):
    live, _ = guarded
    slow = []
    for _ in range(
        6
    ):  # three times the concurrency limit, each declaring 200 bytes and sending one per 0.3 s
        sock = raw_connection(live.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b"Content-Length: 200\r\n\r\n{")
        slow.append(sock)

    def trickle() -> None:
        for _ in range(6):
            time.sleep(0.3)
            for sock in slow:
                try:
                    sock.sendall(b" ")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    with httpx.Client(base_url=live.url, timeout=10) as client:
        for _ in range(4):  # other clients are served at once (bound: 2 s each on this tiny model)
            started = time.monotonic()
            r = client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 2.0
    for sock in slow:  # and the slow ones get a 408 once body_timeout_s is over
        answer = read_all(sock, timeout=5)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_timeout" in answer
        sock.close()


def test_idle_connections_past_the_cap_close_the_oldest_then_are_reaped(guarded):
    live, app = guarded
    limits = live.limits
    idle = [raw_connection(live.url) for _ in range(16)]
    assert wait_for(lambda: len(limits.open) == 16 == limits.count.value, timeout=5)
    newer = [raw_connection(live.url) for _ in range(8)]
    # Past the cap each new connection closes the oldest idle one, without a word (it never sent anything); the
    # count stays at the cap, and /health answers at once.
    for sock in idle[:8]:
        assert read_all(sock, timeout=3) == b""
    assert limits.evicted == 8 and limits.refused == 0 and limits.count.value == 16
    assert httpx.get(f"{live.url}/health", timeout=2).status_code == 200
    # The rest are closed once header_timeout_s (1 s) is over.
    for sock in idle[8:] + newer:
        assert read_all(sock, timeout=3) == b""
        sock.close()
    assert limits.timed_out >= 15

    def connections_open() -> float:  # the scrape's own connection among them
        return metric(httpx.get(f"{live.url}/metrics", timeout=2).text, "mlaserve_http_connections_open")

    assert wait_for(lambda: connections_open() == 1, timeout=5)
    # Each close is counted by why, the evictions apart from the header timeouts.
    page = httpx.get(f"{live.url}/metrics", timeout=2).text
    closed = 'mlaserve_http_connections_closed_total{reason="%s"}'
    assert metric(page, closed % "evicted") == limits.evicted >= 8
    assert metric(page, closed % "header_timeout") == limits.timed_out >= 15
    assert metric(page, closed % "refused") == limits.refused == 0


def test_thousands_of_idle_connections_leave_health_answering_on_both_ports(engine):
    """2,000 idle connections to the API port (twice its cap of 1,024) and 100 to the ops port (three times its
    budget): /health answers 200 within 1 s on each, the API port's count never passes its cap, and the ops port's
    connections do not count against the API port."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2_000 + 100 + 1_024 + connections.OPS_MAX_CONNECTIONS + 256  # both ends live in this process
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < needed:
        pytest.skip(f"needs {needed} open files")
    with serving(engine, ops=True, header_timeout_s=30.0) as (live, _):
        assert live.limits.max_connections == 1_024
        idle = [raw_connection(live.url) for _ in range(2_000)]
        idle += [raw_connection(live.ops_url) for _ in range(100)]
        try:
            for url in (live.url, live.ops_url):
                started = time.monotonic()
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
                assert time.monotonic() - started < 1.0, url
            assert live.limits.count.value <= 1_024 and live.limits.refused == 0
            assert live.ops_limits.count.value <= connections.OPS_MAX_CONNECTIONS
            assert live.limits.evicted >= 2_000 - 1_024 and live.ops_limits.evicted >= 100 - 32
        finally:
            for sock in idle:
                sock.close()


def test_slow_headers_get_a_408_after_the_header_deadline(guarded):
    live, _ = guarded
    sock = raw_connection(live.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    for _ in range(8):
        time.sleep(0.25)
        try:
            sock.sendall(b"X")
        except OSError:
            break
    answer = read_all(sock, timeout=5)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 2.0
    sock.close()


def test_a_kept_alive_connection_idle_between_requests_is_closed(engine):
    with serving(engine, keep_alive_timeout_s=0.5, header_timeout_s=5) as (live, _):
        sock = raw_connection(live.url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        answer = read_all(sock, timeout=5)  # the reply, then the close after 0.5 s idle
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer
        assert 0.4 < time.monotonic() - started < 2.0
        sock.close()


UNICODE_BODIES = [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "Hi", "max_tokens": 2}', "model"),
    ("/v1/completions", '{"prompt": "Hi \\udfff there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\ud83d"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\udc00"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi", "name": "\\udead"}]}',
        "messages",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "\\ud800"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
]


@pytest.mark.parametrize("path, body, param", UNICODE_BODIES)
def test_lone_surrogates_are_a_400_naming_the_field(guarded, path, body, param):
    live, _ = guarded
    r = httpx.post(f"{live.url}{path}", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "surrogate" in error["message"] and error["param"] == param and error["code"] == "invalid_unicode"
    # A valid surrogate pair (one emoji) is text like any other.
    emoji = b'{"prompt": "w4 \\ud83d\\ude00", "max_tokens": 1}'
    ok = httpx.post(f"{live.url}/v1/completions", content=emoji, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_keep_alive_replies_are_not_held_back_by_nagle(guarded):
    live, _ = guarded
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    times = []
    for _ in range(40):
        started = time.perf_counter()
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        times.append(time.perf_counter() - started)
    conn.close()
    assert statistics.median(times) < 0.010, times  # 44 ms with Nagle's delay on every reply


def test_tiny_top_p_samples_the_top_token_not_end_of_text(guarded):
    live, _ = guarded
    with httpx.Client(base_url=live.url, timeout=10) as client:
        greedy = client.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 8, "ignore_eos": True}
        ).json()
        body = {
            **COMPLETION,
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 1.0,
            "top_p": 1e-46,
            "seed": 3,
        }
        tiny = client.post("/v1/completions", json=body).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_n_counts_against_the_concurrency_limit(tiny_model):
    engine = make_engine(tiny_model, step_delay_s=0.02)
    try:
        with serving(engine, max_concurrent_requests=3) as (live, _):
            with httpx.Client(base_url=live.url, timeout=30) as client:
                r = client.post("/v1/completions", json={**COMPLETION, "n": 4})
                assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
                r = client.post("/v1/completions", json={**COMPLETION, "prompt": ["w1", "w2"], "n": 2})
                assert r.status_code == 400  # 2 prompts x n=2 = 4 sequences > 3

                long = {**COMPLETION, "max_tokens": 60, "ignore_eos": True, "n": 2}
                holder = threading.Thread(
                    target=lambda: client.post("/v1/completions", json=long), daemon=True
                )
                holder.start()
                assert wait_for(lambda: app_in_flight(live) == 2, timeout=5)
                r = httpx.post(f"{live.url}/v1/completions", json={**COMPLETION, "n": 2}, timeout=10)
                assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                r = httpx.post(f"{live.url}/v1/completions", json=COMPLETION, timeout=10)
                assert r.status_code == 200  # one sequence still fits
                holder.join(30)
    finally:
        engine.shutdown()


def app_in_flight(live) -> int:
    return live.server.config.app.state.server.in_flight


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """The word-level tokenizer (no normalizer: the length bound applies) and a 65,536-token context."""
    return build_tiny("llama", tmp_path_factory.mktemp("long_llama"), max_position_embeddings=65536)


@pytest.fixture(scope="module")
def long_word_model(tmp_path_factory):
    """The long-context model whose vocabulary holds one 300-character word: the bytes-per-token bound then
    proves nothing about a 1 MB prompt, so only the piecewise count can refuse it early."""
    path = build_tiny("llama", tmp_path_factory.mktemp("long_word"), max_position_embeddings=65536)
    config_file = path / "tokenizer.json"
    config = json.loads(config_file.read_text())
    vocab = config["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    vocab["x" * 300] = vocab.pop(last)
    config_file.write_text(json.dumps(config))
    return path


def test_a_megabyte_prompt_is_counted_only_up_to_the_limit(long_word_model):
    # SmolLM2's context: the count stops after about 8,192 of the prompt's 333,334 tokens.
    engine = make_engine(long_word_model, num_kv_blocks=600, max_model_len=8192)
    try:
        with serving(engine, max_body_bytes=8 * 1024 * 1024) as (live, _):
            arrivals: list[float] = []

            def stream() -> None:
                body = {"prompt": "w7 w8", "max_tokens": 300, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                    arrivals.extend(
                        time.perf_counter() for line in r.iter_lines() if line.startswith("data: {")
                    )

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            assert wait_for(lambda: len(arrivals) > 20, timeout=20)
            prompt = ("w5 " * 340_000)[:1_000_000]
            body = json.dumps({"prompt": prompt}).encode()
            with httpx.Client(base_url=live.url, timeout=60) as client:
                client.post("/tokenize", json={"prompt": "w5"})  # a warm connection and intake thread
                started = time.perf_counter()
                r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - started
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert "max_model_len=8192" in r.json()["error"]["message"]
            assert elapsed < 0.1, elapsed
            reader.join(60)
            during = [t for t in arrivals if started - 0.05 <= t <= started + elapsed + 0.05]
            gaps = [b - a for a, b in zip(during, during[1:])]
            assert during and max(gaps, default=0.0) < 0.050, (elapsed, max(gaps))
    finally:
        engine.shutdown()


def test_a_huge_prompt_does_not_delay_a_running_stream(long_context_model):
    engine = make_engine(long_context_model, num_kv_blocks=4200, max_model_len=65536)
    try:
        with serving(engine, max_body_bytes=8 * 1024 * 1024) as (live, _):
            arrivals: list[float] = []
            usage: list[dict] = []

            def stream() -> None:
                body = {"prompt": "w7 w8", "max_tokens": 600, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.perf_counter())
                            if (chunk := json.loads(line.removeprefix("data: ")))["usage"]:
                                usage.append(chunk["usage"])

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            assert wait_for(lambda: len(arrivals) > 20, timeout=20)
            windows = []
            for size in (250_000, 1_000_000):  # tokenized (then too long), and refused by its length alone
                started = time.perf_counter()
                prompt = ("w5 " * size)[:size]  # 250 kB: 83,334 tokens; 1 MB: at least 250,000 by its length
                r = httpx.post(f"{live.url}/v1/completions", json={"prompt": prompt}, timeout=60)
                windows.append((started, time.perf_counter()))
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            reader.join(60)
            # The stream ran to its end. Tokens that add no text (special ones: how many depends on the random
            # model's greedy choices on this CPU) send no chunk, so the tokens are counted from the final usage.
            assert not reader.is_alive() and usage and usage[-1]["completion_tokens"] == 600, usage
            for start, end in windows:
                during = [t for t in arrivals if start - 0.05 <= t <= end + 0.05]
                gaps = [b - a for a, b in zip(during, during[1:])]
                assert during and max(gaps, default=0.0) < 0.050, (end - start, max(gaps))
    finally:
        engine.shutdown()
