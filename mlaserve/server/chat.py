"""POST /v1/chat/completions: the model's chat template, then the same generation path as completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.engine.step_trace import trace
from mlaserve.server.body import validate
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.generation import Generation
from mlaserve.server.logprobs import chat_logprobs
from mlaserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Delta,
)
from mlaserve.server.sampling import build_params, chat_max_tokens, constraint_field, prepare_choices
from mlaserve.server.sampling import chat_logprobs as requested_logprobs
from mlaserve.server.sse import DONE, EventStreamResponse, sse, text_chunk_writer
from mlaserve.server.state import ServerState


async def create_chat_completion(
    state: ServerState, request: Request, body: dict, arrival: float
) -> Response:
    req = validate(ChatCompletionRequest, body)
    state.check_model(req.model)
    created = int(time.time())
    if not req.messages:
        raise bad_request("messages must be a non-empty list of chat messages", "messages")
    max_tokens, field = chat_max_tokens(req)
    top = requested_logprobs(req)
    params = build_params(req, max_tokens, top, field)
    prepared, prompt_tokens = await prepare_choices(
        state.intake, req, params, field, grammar_field=constraint_field(req)
    )
    table = await state.token_texts.table() if top is not None else []
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation.for_request(state, prepared, request_id, prompt_tokens, arrival)
    model = state.settings.served_model_name
    if req.stream:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        events = _events(gen, len(prepared), request_id, created, model, table, top or 0, continuous)
        return EventStreamResponse(events, gen.close)
    try:
        results = await gen.collect(request)
    finally:
        gen.close()
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content=r.text),
            logprobs=None if r.logprobs is None else chat_logprobs(r.token_ids, r.logprobs, table, top or 0),
            finish_reason=r.finish_reason,
        )
        for index, r in enumerate(results)
    ]
    usage = gen.usage()
    response = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


async def _events(
    gen: Generation,
    num_choices: int,
    request_id: str,
    created: int,
    model: str,
    table: list[str],
    top: int,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    def chunk(choice: ChatChunkChoice) -> str:
        usage = gen.usage() if continuous_usage else None  # vLLM's stream_options.continuous_usage_stats
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=[choice], usage=usage
            ).model_dump()
        )

    # The hot path (a text delta, no logprobs): the same JSON as `chunk`, without building pydantic models.
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def payload(index: object, text: object, usage: dict | None) -> dict:
        delta = {"role": None, "content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**head, "choices": [choice], "usage": usage}

    text_chunk = text_chunk_writer(payload, (lambda: gen.usage().model_dump()) if continuous_usage else None)

    try:
        # OpenAI opens each choice with the role, before any token.
        yield "".join(
            chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")))
            for i in range(num_choices)
        )
        async for batch in gen.updates():
            events: list[str] = []  # one write per batch: whatever tokens were ready leave together
            for u in batch:
                if u.text and u.logprobs is None:
                    events.append(text_chunk(u.index, u.text))
                elif u.text or (u.logprobs and u.token_ids):
                    logprobs = (
                        None if u.logprobs is None else chat_logprobs(u.token_ids, u.logprobs, table, top)
                    )
                    events.append(
                        chunk(ChatChunkChoice(index=u.index, delta=Delta(content=u.text), logprobs=logprobs))
                    )
                if u.finish_reason is not None:
                    events.append(
                        chunk(ChatChunkChoice(index=u.index, delta=Delta(), finish_reason=u.finish_reason))
                    )
            if events:
                yield "".join(events)
                trace("api_written", int(any(u.finish_reason is not None for u in batch)))
        usage = gen.usage()
        final = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
        yield sse(final.model_dump()) + DONE
        return
    except OpenAIError as error:
        yield sse(error.body())
    yield DONE
