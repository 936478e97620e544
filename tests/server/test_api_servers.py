"""Several API-server processes in front of one engine core: each request is answered by the core's tokens for
it (the core routes every delta to the process that sent the request), and /metrics from any process counts the
whole server."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.server.api_servers import per_process_share
from mlaserve.server.settings import ServerSettings
from tests.server.conftest import ENGINE_OPTIONS
from tests.server.test_shutdown import serve_process  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


def test_each_api_server_enforces_its_share_of_the_limits():
    share = per_process_share(
        ServerSettings(max_concurrent_requests=10, max_connections=1024, api_server_count=3)
    )
    assert (share.max_concurrent_requests, share.max_connections) == (4, 342)
    alone = ServerSettings(max_concurrent_requests=10)
    assert per_process_share(alone) is alone


def test_three_api_servers_answer_like_the_offline_api_and_count_together(serve_process, tiny_model):  # noqa: F811
    server = serve_process(10.0, api_servers=3)
    _, pids = server.pids()
    assert len(pids) == 3
    prompts = [f"w{5 + i} w{40 + 3 * i} w7" for i in range(12)]
    offline = LLM(str(tiny_model), **ENGINE_OPTIONS)
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)

    def complete(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(12) as pool:  # at once: the processes accept them in parallel
        got = list(pool.map(complete, prompts))
    assert got == [w.outputs[0].text for w in want]
    for _ in range(6):  # whichever process answers the scrape, it counts all twelve
        page = httpx.get(f"{server.url}/metrics", timeout=10).text
        ok = re.search(r'^mlaserve_requests_total\{status="ok"\} (\S+)$', page, re.M)
        assert ok and float(ok.group(1)) == 12, page[:2000]
        assert re.search(r"^mlaserve_http_requests_in_flight 0\.0$", page, re.M)


def test_a_client_that_leaves_an_extra_api_server_frees_its_blocks(serve_process):  # noqa: F811
    """Aborts travel from whichever process accepted the stream to the core over that process's own pipe."""
    server = serve_process(10.0, api_servers=2)

    def blocks_used() -> float:
        page = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.search(r"^mlaserve_kv_blocks_used (\S+)$", page, re.M)
        return float(found.group(1))

    body = {"prompt": "w5 w6", "max_tokens": 250, "ignore_eos": True, "stream": True}  # 2.5 s of 10 ms steps

    def leave_after_the_first_token(_: int) -> str:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
            return r.headers["X-Mlaserve-Api-Server"]

    served_by: set[str] = set()
    for _ in range(10):  # until the extra process has accepted some of them (the kernel picks the process)
        with ThreadPoolExecutor(6) as pool:
            served_by.update(pool.map(leave_after_the_first_token, range(6)))
        if "1" in served_by:
            break
    assert "1" in served_by, served_by
    left = time.monotonic()
    while blocks_used() and time.monotonic() < left + 1.0:  # well before the streams could have finished
        time.sleep(0.05)
    assert blocks_used() == 0
