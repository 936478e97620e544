"""POST /v1/completions: one choice per prompt and per n, whole or streamed as text deltas."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.server.body import parse_json_object, read_body, validate
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.generation import Generation
from mlaserve.server.logprobs import completion_logprobs
from mlaserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from mlaserve.server.sampling import build_params, completion_prompts, prepare_choices
from mlaserve.server.sse import DONE, EventStreamResponse, sse
from mlaserve.server.state import ServerState


async def create_completion(state: ServerState, request: Request, arrival: float) -> Response:
    """Admission is done by the caller; on return or raise the response owns `Generation.close`."""
    req = validate(
        CompletionRequest, parse_json_object(await read_body(request, state.settings.max_body_bytes))
    )
    state.check_model(req.model)
    if req.echo:
        raise bad_request("echo=true is not supported", "echo")
    params = build_params(req, req.max_tokens, req.logprobs)
    explicit = "max_tokens" if "max_tokens" in req.model_fields_set else None
    prepared, prompt_tokens = await prepare_choices(state.engine, completion_prompts(req), params, explicit)
    table = await state.token_texts.table() if req.logprobs is not None else []
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation.for_request(state, prepared, request_id, prompt_tokens, arrival)
    model = state.settings.served_model_name
    if req.stream:
        return EventStreamResponse(_events(gen, request_id, state.created, model, table), gen.close)
    try:
        results = await gen.collect(request)
    finally:
        gen.close()
    choices = []
    for index, r in enumerate(results):
        logprobs = None if r.logprobs is None else completion_logprobs(r.token_ids, r.logprobs, table, 0)
        choices.append(
            CompletionChoice(index=index, text=r.text, logprobs=logprobs, finish_reason=r.finish_reason)
        )
    usage = gen.usage()
    body = CompletionResponse(id=request_id, created=state.created, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


async def _events(
    gen: Generation, request_id: str, created: int, model: str, table: list[str]
) -> AsyncIterator[str]:
    def chunk(choice: CompletionChoice) -> str:
        return sse(
            CompletionResponse(id=request_id, created=created, model=model, choices=[choice]).model_dump()
        )

    offsets: dict[int, int] = {}
    try:
        async for batch in gen.updates():
            for u in batch:
                if u.text or (u.logprobs and u.token_ids):  # logprobs keep their tokens even if text is held
                    logprobs = None
                    if u.logprobs is not None:
                        logprobs = completion_logprobs(
                            u.token_ids, u.logprobs, table, offsets.get(u.index, 0)
                        )
                    offsets[u.index] = offsets.get(u.index, 0) + len(u.text)
                    yield chunk(CompletionChoice(index=u.index, text=u.text, logprobs=logprobs))
                if u.finish_reason is not None:
                    yield chunk(CompletionChoice(index=u.index, text="", finish_reason=u.finish_reason))
        usage = gen.usage()
        final = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
        yield sse(final.model_dump())
    except OpenAIError as error:
        yield sse(error.body())
    yield DONE
