"""The streaming hot path writes text chunks without pydantic: they must be exactly the models' JSON."""

from __future__ import annotations

import json
import random

import httpx

from mlaserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    Delta,
)
from mlaserve.server.sse import INDEX_SLOT, TEXT_SLOT, sse, sse_template
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


def test_sse_template_gives_sse_of_the_filled_payload():
    rng = random.Random(0)
    alphabet = ['"', "\\", "\n", "\x00", "é", "世", "🙂", "a", " ", "\x00text", "index"]
    for _ in range(200):
        # Client-chosen strings before the slots may contain the slots' own text: they are found from the end.
        model = "".join(rng.choices(alphabet, k=rng.randrange(0, 6)))
        head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": model}

        def payload(index: object, text: object, head: dict = head) -> dict:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
            return {**head, "choices": [choice], "usage": None}

        fill = sse_template(payload(INDEX_SLOT, TEXT_SLOT), INDEX_SLOT, TEXT_SLOT)
        index, text = rng.randrange(0, 20), "".join(rng.choices(alphabet, k=rng.randrange(0, 8)))
        assert fill(index, text) == sse(payload(index, text))
