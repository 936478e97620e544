"""Several API-server processes in front of one engine core: each request is answered by the core's tokens for
it (the core routes every delta to the process that sent the request), /metrics from any process counts the
whole server, and max_concurrent_requests holds for the server, however the kernel spreads the connections."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from mlaserve import LLM, SamplingParams
from tests.server.conftest import ENGINE_OPTIONS, wait_for
from tests.server.test_shutdown import serve_process  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


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


@dataclass
class Answer:
    """One streamed completion as its client saw it."""

    status: int = 0
    served_by: str = ""  # X-Mlaserve-Api-Server
    error: dict = field(default_factory=dict)  # a refusal's error object
    events: list = field(default_factory=list)  # the SSE payloads, "[DONE]" as a string


def stream(url: str, body: dict, answer: Answer, first_event: threading.Barrier | None = None) -> None:
    """Stream one completion into `answer`; a served one waits at `first_event` after its first event, so that the
    caller knows every stream of the round is in flight at once."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        answer.status, answer.served_by = r.status_code, r.headers.get("X-Mlaserve-Api-Server", "")
        if r.status_code != 200:
            answer.error = json.loads(r.read())["error"]
            if first_event is not None:
                first_event.abort()  # the round failed: nobody waits for this stream
            return
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                answer.events.append(data if data == "[DONE]" else json.loads(data))
                if first_event is not None and len(answer.events) == 1:
                    first_event.wait()


def in_flight(url: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^mlaserve_http_requests_in_flight (\S+)$", page, re.M).group(1))


def test_max_concurrent_requests_is_the_servers_not_split_among_the_processes(serve_process):  # noqa: F811
    """8 streams at once on a limit of 8 over two processes are all served in every round, whichever process
    accepts how many (with each process holding half of the limit, a round where one accepted five saw a 429);
    14 at once still see 6 refusals that name the limit, and every slot comes back."""
    server = serve_process(10.0, api_servers=2, max_concurrent_requests=8)
    tokens = 120  # 1.2 s of 10 ms steps: every stream of a round outlives their start
    body = {"prompt": "w5 w6 w7", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    spreads = []
    for _ in range(4):
        answers = [Answer() for _ in range(8)]
        first_event = threading.Barrier(9, timeout=30)  # the 8 streams and this thread
        threads = [threading.Thread(target=stream, args=(server.url, body, a, first_event)) for a in answers]
        for t in threads:
            t.start()
        try:
            first_event.wait()
            counted = in_flight(server.url)  # all 8 running: the count is the server's, on either process
        except threading.BrokenBarrierError:
            counted = -1
        for t in threads:
            t.join(60)
        spreads.append(sorted(a.served_by for a in answers))
        assert [a.status for a in answers] == [200] * 8, ([a.error for a in answers], spreads)
        assert counted == 8
        for a in answers:
            assert a.events[-1] == "[DONE]" and a.events[-2]["usage"]["completion_tokens"] == tokens
    assert {"0", "1"} <= {p for spread in spreads for p in spread}, spreads  # both processes served

    answers = [Answer() for _ in range(14)]
    threads = [threading.Thread(target=stream, args=(server.url, body, a)) for a in answers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    refused = [a for a in answers if a.status == 429]
    assert sorted(a.status for a in answers) == [200] * 8 + [429] * 6, [a.error for a in answers]
    assert all("max_concurrent_requests=8" in a.error["message"] for a in refused), refused[0].error
    for _ in range(6):  # whichever process answers the scrape: every slot came back
        assert wait_for(lambda: in_flight(server.url) == 0, timeout=5)
