"""The streaming hot path writes text chunks without pydantic: they must be exactly the models' JSON."""

from __future__ import annotations

import json

import httpx

from mlaserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    Delta,
)
from tests.server.conftest import make_engine, serving


def test_streamed_text_chunks_are_the_protocol_models_json(tiny_model):
    engine = make_engine(tiny_model)
    try:
        with serving(engine, served_model_name="tiny") as (live, _):
            body = {"prompt": "w5 w6", "max_tokens": 3, "stream": True, "temperature": 0}
            lines = httpx.post(f"{live.url}/v1/completions", json=body).text.splitlines()
            chunk = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            choice = CompletionChoice(**chunk["choices"][0])
            model = CompletionResponse(
                id=chunk["id"], created=chunk["created"], model="tiny", choices=[choice]
            )
            assert chunk == model.model_dump()
            body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "stream": True}
            lines = httpx.post(f"{live.url}/v1/chat/completions", json=body).text.splitlines()
            data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            chunk = next(c for c in data if c["choices"] and c["choices"][0]["delta"].get("content"))
            delta = Delta(**chunk["choices"][0]["delta"])
            choice = ChatChunkChoice(index=0, delta=delta)
            model = ChatCompletionChunk(
                id=chunk["id"], created=chunk["created"], model="tiny", choices=[choice]
            )
            assert chunk == model.model_dump()
    finally:
        engine.shutdown()
