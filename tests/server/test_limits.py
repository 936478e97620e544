"""Concurrency limit (429), request timeout, health while draining, /metrics, the ops app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from mlaserve.config.server_settings import ServerSettings
from mlaserve.server.app import build_app, build_ops_app
from tests.server.conftest import (
    fresh_stats,
    live_server,
    make_engine,
    metric,
    sse_events,
    vllm_samples,
    wait_for,
)

LONG = {"prompt": "w5 w6", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def slow_engine(tiny_model):
    engine = make_engine(tiny_model, step_delay_s=0.01)
    yield engine
    engine.shutdown()


def test_past_max_concurrent_requests_is_429_with_retry_after(slow_engine):
    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            streams = [
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) for _ in range(2)
            ]
            responses = [await s.__aenter__() for s in streams]
            lines = [r.aiter_lines() for r in responses]
            for it in lines:  # both admitted and running
                assert (await it.__anext__()).startswith("data: ")
            assert metric((await client.get("/metrics")).text, "mlaserve_http_requests_in_flight") == 2
            r = await client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1})
            assert r.status_code == 429
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "on this server (max_concurrent_requests=2)" in r.json()["error"]["message"]
            for s in streams:
                await s.__aexit__(None, None, None)  # the clients leave: their slots come back
            for _ in range(250):
                if metric((await client.get("/metrics")).text, "mlaserve_http_requests_in_flight") == 0:
                    break
                await asyncio.sleep(0.02)
            r = await client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1})
            assert r.status_code == 200

    for live, _ in live_server(slow_engine, max_concurrent_requests=2):
        asyncio.run(scenario(live.url))
        page = httpx.get(f"{live.url}/metrics").text
        assert metric(page, 'mlaserve_requests_total{status="throttled"}') == 1
        assert metric(page, 'mlaserve_requests_total{status="aborted"}') == 2


def test_request_past_the_timeout_is_aborted_with_an_error(slow_engine):
    async def scenario(url: str) -> list:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/v1/completions", json=LONG)
            assert r.status_code == 408
            assert r.json()["error"]["code"] == "request_timeout"
            assert "request_timeout_s=0.3" in r.json()["error"]["message"]
            chat = {"messages": [{"role": "user", "content": "w1"}], **LONG, "stream": True}
            del chat["prompt"]
            async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                assert response.status_code == 200  # the headers went out before the deadline
                return await sse_events(response)

    for live, _ in live_server(slow_engine, request_timeout_s=0.3):
        events = asyncio.run(scenario(live.url))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "request_timeout"
        assert wait_for(lambda: fresh_stats(slow_engine)["kv_blocks_used"] == 0)
        page = httpx.get(f"{live.url}/metrics").text
        assert metric(page, 'mlaserve_requests_total{status="timeout"}') == 2


def test_health_is_503_while_draining_and_when_the_engine_loop_is_gone(tiny_model):
    engine = make_engine(tiny_model)
    app = build_app(engine, ServerSettings(), {})
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        app.state.server.draining = True
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert client.get("/v1/models").status_code == 503
        assert metric(client.get("/metrics").text, 'mlaserve_requests_total{status="unavailable"}') == 1
        app.state.server.draining = False
        engine.shutdown()
        assert client.get("/health").json() == {"status": "engine loop not running"}
        assert client.post("/v1/completions", json={"prompt": "w1"}).status_code == 503


def test_metrics_page_has_the_operator_series(tiny_model):
    engine = make_engine(tiny_model)
    app = build_app(engine, ServerSettings(), {})
    other = build_app(engine, ServerSettings(), {})  # its own registry: counts do not leak across apps
    try:
        with TestClient(app) as client:
            for stream in (False, True):
                body = {"prompt": "w3 w4 w5", "max_tokens": 5, "ignore_eos": True, "stream": stream}
                assert client.post("/v1/completions", json=body).status_code == 200
            client.post("/v1/completions", json={"prompt": ""})
            page = client.get("/metrics")
            assert page.headers["content-type"].startswith("text/plain")
            text = page.text
        assert metric(text, 'mlaserve_requests_total{status="ok"}') == 2
        assert metric(text, 'mlaserve_requests_total{status="rejected"}') == 1
        vllm = vllm_samples(text)
        assert vllm["vllm:prompt_tokens_total"] == 6
        assert vllm["vllm:generation_tokens_total"] == 10
        assert vllm["vllm:time_to_first_token_seconds_count"] == 2
        # 4 gaps per request; fewer only if a slow reader got two tokens in one delivery
        assert 1 <= vllm["vllm:inter_token_latency_seconds_count"] <= 8
        assert vllm["vllm:e2e_request_latency_seconds_count"] == 2
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
            assert vllm[name] >= 0
        for name in ("mlaserve_kv_blocks_used", "mlaserve_prefix_cache_hit_rate", "mlaserve_engine_alive"):
            assert metric(text, name) >= 0
        assert metric(text, "mlaserve_kv_blocks_total") == fresh_stats(engine)["kv_blocks_total"]
        with TestClient(other) as client:
            assert metric(client.get("/metrics").text, 'mlaserve_requests_total{status="ok"}') == 0
    finally:
        engine.shutdown()


def test_ops_app_serves_health_and_metrics_without_auth_and_nothing_else(tiny_model):
    engine = make_engine(tiny_model)
    app = build_app(engine, ServerSettings(api_keys=("secret",)), {})
    try:
        with TestClient(build_ops_app(app)) as ops:
            assert ops.get("/health").status_code == 200
            assert "mlaserve_requests_total" in ops.get("/metrics").text
            r = ops.get("/v1/models", headers={"Authorization": "Bearer secret"})
            assert r.status_code == 404 and "error" in r.json()
            app.state.server.draining = True
            assert ops.get("/health").status_code == 503  # one state behind both apps
    finally:
        engine.shutdown()


def test_a_non_streaming_client_that_leaves_aborts_its_request(slow_engine):
    for live, _ in live_server(slow_engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=LONG, timeout=0.3)  # 200 steps take ~2 s
        assert wait_for(lambda: slow_engine.num_in_flight == 0, timeout=1.0)
        assert fresh_stats(slow_engine)["kv_blocks_used"] == 0
        page = httpx.get(f"{live.url}/metrics").text
        assert metric(page, 'mlaserve_requests_total{status="aborted"}') == 1
