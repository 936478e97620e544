"""64 concurrent streams on a live server, 8 of them hung up mid-stream by their clients."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlaserve import LLM, SamplingParams
from tests.server.conftest import (
    ENGINE_OPTIONS,
    fresh_stats,
    live_server,
    make_engine,
    metric,
    sse_events,
    vllm_samples,
    wait_for,
)

NUM_STREAMS, NUM_DISCONNECTS, MAX_TOKENS = 64, 8, 16


def prompt(i: int) -> str:
    return " ".join(f"w{3 + (i * 7 + k * 13) % 250}" for k in range(4 + i % 9))


@pytest.fixture(scope="module")
def server(tiny_model):
    # 2 ms per step keeps the 8 long requests in flight while their clients leave.
    engine = make_engine(tiny_model, step_delay_s=0.002)
    for live, app in live_server(engine, max_concurrent_requests=NUM_STREAMS):
        yield live, app, engine
    engine.shutdown()


async def complete(client: httpx.AsyncClient, i: int) -> str:
    body = {"prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] >= 1  # the final usage chunk
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


async def hang_up(client: httpx.AsyncClient, i: int) -> int:
    body = {"prompt": prompt(i), "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break  # leaving the block closes the connection mid-stream
    return seen


async def run_all(url: str) -> tuple[list, list]:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 8, max_keepalive_connections=NUM_STREAMS + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        leavers = set(range(0, NUM_STREAMS, NUM_STREAMS // NUM_DISCONNECTS))
        tasks = [hang_up(client, i) if i in leavers else complete(client, i) for i in range(NUM_STREAMS)]
        results = await asyncio.gather(*tasks)
    texts = [(i, r) for i, r in enumerate(results) if i not in leavers]
    return texts, [r for i, r in enumerate(results) if i in leavers]


def test_64_streams_8_disconnect_blocks_freed_and_aborts_counted(server, tiny_model):
    live, app, engine = server
    texts, left = asyncio.run(run_all(live.url))
    assert len(texts) == NUM_STREAMS - NUM_DISCONNECTS and left == [2] * NUM_DISCONNECTS
    offline = LLM(str(tiny_model), **ENGINE_OPTIONS)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = offline.generate([prompt(i) for i, _ in texts], greedy, use_tqdm=False)
    assert [t for _, t in texts] == [o.outputs[0].text for o in want]

    assert wait_for(lambda: fresh_stats(engine)["kv_blocks_used"] == 0 and engine.num_in_flight == 0)
    page = httpx.get(f"{live.url}/metrics").text
    assert metric(page, 'mlaserve_requests_total{status="aborted"}') == NUM_DISCONNECTS
    assert metric(page, 'mlaserve_requests_total{status="ok"}') == NUM_STREAMS - NUM_DISCONNECTS
    assert metric(page, "mlaserve_http_requests_in_flight") == 0
    # vLLM's dashboards count a hang-up as a request finished by abort.
    vllm = vllm_samples(page)
    assert vllm["vllm:request_success_total{finished_reason=abort}"] == NUM_DISCONNECTS
    assert vllm["vllm:request_success_total{finished_reason=length}"] == NUM_STREAMS - NUM_DISCONNECTS
    assert wait_for(lambda: metric(httpx.get(f"{live.url}/metrics").text, "mlaserve_kv_blocks_used") == 0)
