"""SIGTERM on a real `serve()` process: running streams finish (or are aborted after the grace), new requests
are refused, and the process exits 0 in time."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Each step sleeps 10 ms so that the streams are still running when the signal arrives. The engine core runs in
# a spawned process of its own, so the slow step is installed by a sitecustomize module that every Python process
# started with this PYTHONPATH imports, the core's included.
SLOW_STEPS = """
from mlaserve.engine.core import EngineCore
import time
step = EngineCore.step
def slow_step(self):
    time.sleep(0.01)
    return step(self)
EngineCore.step = slow_step
"""
SERVE = """
import json, sys
from mlaserve.server.run import serve
from mlaserve.config.server_settings import ServerSettings
options = dict(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)
settings = ServerSettings(port=0, metrics_port=0, shutdown_grace_s=float(sys.argv[2]), api_server_count=int(sys.argv[3]), **json.loads(sys.argv[4]))
sys.exit(serve(options, settings))
"""


class ServeProcess:
    def __init__(
        self, model: Path, grace_s: float, site: Path, api_servers: int = 1, settings: dict | None = None
    ) -> None:
        """`settings`: more ServerSettings fields, as JSON values."""
        (site / "sitecustomize.py").write_text(SLOW_STEPS)
        path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
        args = [str(model), str(grace_s), str(api_servers), json.dumps(settings or {})]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, *args],
            env={**os.environ, "PYTHONPATH": path},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        assert wait_for(lambda: self.ports() is not None or self.proc.poll() is not None, timeout=60)
        assert self.ports() is not None, "\n".join(self.lines)
        self.url, self.ops_url = (f"http://127.0.0.1:{p}" for p in self.ports())
        assert wait_for(lambda: self._health() == 200, timeout=20)

    def pids(self) -> tuple[int, list[int]]:
        """(the engine core's pid, the API servers' pids), from the start-up report."""
        found = re.search(
            r"processes: engine core pid (\d+); \d+ API server\(s\), pid ([\d, ]+)", "\n".join(self.lines)
        )
        assert found, "\n".join(self.lines)
        return int(found.group(1)), [int(p) for p in found.group(2).split(", ")]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def ports(self) -> tuple[str, str] | None:
        text = "\n".join(self.lines)
        main = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        ops = re.search(r"/metrics also on http://127\.0\.0\.1:(\d+)", text)
        return (main.group(1), ops.group(1)) if main and ops else None

    def _health(self, url: str | None = None) -> int:
        try:
            return httpx.get(f"{url or self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return -1

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Stream(threading.Thread):
    """One streaming completion in a thread, recording its SSE payloads."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[dict | str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "w5 w6 w7", "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def start_streams(url: str, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(url, max_tokens) for _ in range(count)]
    for s in streams:
        s.start()
    assert wait_for(lambda: all(len(s.events) >= 2 for s in streams), timeout=30), "streams did not start"
    return streams


def refused(url: str) -> bool:
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w1", "max_tokens": 1}, timeout=5)
    except httpx.ConnectError:
        return True
    return r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


@pytest.fixture
def serve_process(tiny_model, tmp_path):
    processes: list[ServeProcess] = []

    def start(grace_s: float, api_servers: int = 1, **settings: object) -> ServeProcess:
        processes.append(ServeProcess(tiny_model, grace_s, tmp_path, api_servers, settings))
        return processes[-1]

    yield start
    for p in processes:
        p.kill()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigterm_lets_8_streams_finish_refuses_new_ones_and_exits_0(serve_process, api_servers):
    grace = 20.0
    server = serve_process(grace, api_servers)
    streams = start_streams(server.url, 8, max_tokens=120)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: server._health() == 503 and server._health(server.ops_url) == 503, timeout=5)
    assert refused(server.url)
    assert any(s.is_alive() for s in streams), "the streams ended before the refusal was checked"
    for s in streams:
        s.join(timeout=grace)
    assert server.proc.wait(timeout=grace) == 0, "\n".join(server.lines)
    assert time.monotonic() - signalled < grace
    for s in streams:
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        assert s.events[-2]["usage"]["completion_tokens"] == 120
        assert s.events[-3]["choices"][0]["finish_reason"] == "length"


def test_requests_past_the_grace_period_are_aborted_with_an_error_event(serve_process):
    server = serve_process(1.0)
    streams = start_streams(server.url, 2, max_tokens=250)  # ~2.5 s of steps: longer than the grace
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0, "\n".join(server.lines)
    assert time.monotonic() - signalled < 1.0 + 5.0, "\n".join(server.lines)
    for s in streams:
        s.join(timeout=5)
        assert s.events[-1] == "[DONE]"
        assert s.events[-2]["error"]["code"] == "aborted"


def test_posts_on_kept_alive_connections_while_draining_get_a_503(serve_process):
    """Every request that arrives during the drain gets its 503, on new and on reused connections: the body is
    read before the answer, so closing the connection afterwards never resets a client still sending it."""
    server = serve_process(10.0)
    host, port = server.url.removeprefix("http://").split(":")
    connections = []
    for _ in range(30):  # kept-alive connections, each used once before the signal
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
        connections.append(conn)
    streams = start_streams(server.url, 1, max_tokens=240)  # keeps the drain going for ~2.4 s
    server.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: server._health() == 503, timeout=5)
    body = json.dumps({"prompt": "w5 w6 " * 200, "max_tokens": 4}).encode()  # a body of a few kB
    statuses = []
    for conn in connections:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        statuses.append((response.status, json.loads(response.read())["error"]["code"]))
        conn.close()
    assert statuses == [(503, "server_shutting_down")] * len(connections)
    streams[0].join(timeout=15)
    assert server.proc.wait(timeout=15) == 0


@pytest.mark.parametrize("api_servers", [1, 2])
def test_killing_the_engine_core_process_fails_health_and_exits_non_zero(serve_process, api_servers):
    server = serve_process(5.0, api_servers)
    core, servers = server.pids()
    assert len(servers) == api_servers and servers[0] == server.proc.pid
    streams = start_streams(server.url, 4, max_tokens=200)
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_for(lambda: server._health() != 200, timeout=5)  # 503 while stopping, then refused
    assert server.proc.wait(timeout=10) != 0, "\n".join(server.lines)
    assert time.monotonic() - killed < 10
    for s in streams:
        s.join(timeout=5)
        assert s.error is not None or s.events[-2]["error"]["code"] in ("engine_error", "engine_dead")


def test_an_api_server_process_that_dies_takes_the_server_down(serve_process):
    server = serve_process(5.0, api_servers=3)
    core, servers = server.pids()
    streams = start_streams(server.url, 4, max_tokens=200)
    os.kill(servers[2], signal.SIGKILL)
    killed = time.monotonic()
    assert server.proc.wait(timeout=30) != 0, "\n".join(server.lines)
    assert time.monotonic() - killed < 25
    assert "API server 2" in "\n".join(server.lines)
    assert wait_for(lambda: not Path(f"/proc/{core}").exists() and not Path(f"/proc/{servers[1]}").exists())
    for s in streams:
        s.join(timeout=5)
