"""/v1/responses on the tiny model over raw HTTP: it takes the API key like every /v1 route, is counted in the
request metrics, frames each stream event with its `event:` line (no [DONE], as OpenAI's Responses stream), and
its text is chat's for the same messages."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import live_server, make_engine, metric

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "input": "w4 w5", "max_output_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = make_engine(tiny_model)
    for live, _ in live_server(engine, api_keys=(KEY,), served_model_name="tiny"):
        with httpx.Client(base_url=live.url, timeout=30) as client:
            yield client
    engine.shutdown()


def test_needs_the_key_and_is_counted(client):
    assert client.post("/v1/responses", json=BODY).status_code == 401
    before = metric(client.get("/metrics").text, 'mlaserve_requests_total{status="ok"}')
    r = client.post("/v1/responses", json=BODY, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response" and out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"} and out["usage"]["output_tokens"] == 4
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "w4 w5"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        headers=AUTH,
    ).json()
    assert out["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    after = metric(client.get("/metrics").text, 'mlaserve_requests_total{status="ok"}')
    assert after == before + 2


def test_stream_frames_each_event_with_its_type(client):
    with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().strip().split("\n\n")
    events = []
    for frame in frames:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-1]["response"]["output"][0]["content"][0]["text"]
