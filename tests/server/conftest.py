"""Shared pieces of the server tests: a tiny Llama with a chat template, engines, a live uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.engine.llm_engine import LLMEngine
from mlaserve.server.app import build_app, build_ops_app
from mlaserve.server.connections import listening_socket, port_limits, uvicorn_config
from mlaserve.server.http_loop import run_event_loop
from mlaserve.testing.tiny_models import build_tiny

# Word-level: "w10 <content> w11" per message, then "w12" to prompt the answer.
CHAT_TEMPLATE = "{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}{% if add_generation_prompt %}w12{% endif %}"
ENGINE_OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny("llama", tmp_path_factory.mktemp("server_llama"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


def make_engine(model: Path, step_delay_s: float = 0.0, **options: object) -> AsyncEngine:
    """An AsyncEngine on the tiny model; `step_delay_s` slows each step so requests stay in flight."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), **{**ENGINE_OPTIONS, **options}))
    if step_delay_s:
        step = engine.core.step

        def slow_step() -> list:
            time.sleep(step_delay_s)
            return step()

        engine.core.step = slow_step
    return AsyncEngine(engine)


def fresh_stats(engine: AsyncEngine) -> dict:
    """Stats read on the loop thread now (not the snapshot), after every queued abort was applied."""
    return engine.call(lambda e: e.stats()).result(timeout=10)


def wait_for(predicate: object, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a background thread, configured as serve() does
    (the guarded protocol with the app's connection limits, TCP_NODELAY); with `ops`, the ops app too, on a port of
    its own and the same event loop (`ops_url`)."""

    def __init__(self, app: FastAPI, ops: bool = False) -> None:
        state = app.state.server
        settings = state.settings
        self.all_limits = port_limits(
            settings.header_timeout_s,
            settings.max_connections,
            state.counts.connections,
            state.metrics.connection_closed,
        )
        self.limits, self.ops_limits = self.all_limits["api"], self.all_limits["ops"]
        app.state.server.connection_limits = self.limits
        apps = [(app, self.limits)] + ([(build_ops_app(app), self.ops_limits)] if ops else [])
        self.socks = [listening_socket("127.0.0.1", 0) for _ in apps]
        self.sock = self.socks[0]
        urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.socks]
        self.url, self.ops_url = urls[0], urls[-1] if ops else None
        self.servers = [
            uvicorn.Server(uvicorn_config(a, settings, lim, log_level="warning", timeout_graceful_shutdown=2))
            for a, lim in apps
        ]
        self.server = self.servers[0]
        self.thread = threading.Thread(target=lambda: run_event_loop(self._serve()), daemon=True)

    async def _serve(self) -> None:
        await asyncio.gather(*(s.serve(sockets=[sock]) for s, sock in zip(self.servers, self.socks)))

    def __enter__(self) -> LiveServer:
        self.thread.start()
        if not wait_for(lambda: all(s.started for s in self.servers), timeout=10):
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers:
            server.should_exit = True
        self.thread.join(10)
        for sock in self.socks:
            sock.close()


def live_server(
    engine: AsyncEngine, ops: bool = False, **settings: object
) -> Iterator[tuple[LiveServer, FastAPI]]:
    app = build_app(engine, ServerSettings(**settings), {"test": True})
    with LiveServer(app, ops) as server:
        yield server, app


serving = contextlib.contextmanager(live_server)  # `with serving(engine, **settings) as (live, app):`


def metric(text: str, name: str) -> float:
    """The value of one sample of a Prometheus text page, e.g. 'mlaserve_requests_total{status="ok"}'."""
    for line in text.splitlines():
        if line.split(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def vllm_samples(text: str, model_name: str = "mlaserve") -> dict[str, float]:
    """Samples of vLLM-named metrics (`vllm:...`) labelled for `model_name` and engine "0", by sample name (label
    sets other than those two, such as finished_reason, are appended as name{key=value,...})."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if not sample.name.startswith("vllm:"):
                continue
            assert labels.pop("model_name") == model_name and labels.pop("engine") == "0", sample
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[f"{sample.name}{{{extra}}}" if extra else sample.name] = sample.value
    return out


async def sse_events(response: httpx.Response) -> list[dict | str]:
    """Parsed `data:` payloads of a streamed response ("[DONE]" stays a string)."""
    events: list[dict | str] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def run(coro: object) -> object:
    return asyncio.run(coro)
