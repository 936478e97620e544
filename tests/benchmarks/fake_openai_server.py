"""A stand-in OpenAI-compatible server for benchmark tests: streams fixed words at a fixed pace, no engine."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TOKEN_DELAY_S = 0.01


def build_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "tests"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        if body.get("model") != "fake-model":
            return JSONResponse({"error": {"message": "unknown model", "type": "invalid_request_error"}}, 404)
        max_tokens = int(body["max_tokens"])

        async def events() -> AsyncIterator[str]:
            for i in range(max_tokens):
                await asyncio.sleep(TOKEN_DELAY_S)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": max_tokens}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def running_fake_server() -> Iterator[str]:
    """Serve the stand-in on a free loopback port in a thread; yields its /v1 base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    give_up = time.monotonic() + 10
    while not server.started and time.monotonic() < give_up:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
