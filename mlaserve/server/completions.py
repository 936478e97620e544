"""POST /v1/completions: one choice per prompt and per n, whole or streamed as text deltas.

With `echo` the choice starts with the prompt's text and, with `logprobs`, the prompt tokens' logprobs (the first
one null), computed in the prefill; `max_tokens: 0` then scores the prompt alone, which is how evaluation
harnesses ask for log-likelihoods.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.step_trace import trace
from mlaserve.server.body import validate
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.generation import ChoiceUpdate, Generation
from mlaserve.server.logprobs import completion_logprobs
from mlaserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from mlaserve.server.sampling import build_params, completion_prompts, constraint_field, prepare_choices
from mlaserve.server.sse import DONE, EventStreamResponse, sse, text_chunk_writer
from mlaserve.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


@dataclass(slots=True)
class _Echo:
    """What each choice shows before its generated text: the prompt, its ids and (if asked) logprobs."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    with_logprobs: bool

    def logprobs(self, index: int, prompt_logprobs: list | None, table: list[str]) -> CompletionLogprobs:
        ids = self.prompt_ids[index]
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(ids)
        return completion_logprobs(ids, entries, table, 0)


async def create_completion(state: ServerState, request: Request, body: dict, arrival: float) -> Response:
    """Body reading and admission are the caller's; on return or raise the response owns `Generation.close`."""
    req = validate(CompletionRequest, body)
    state.check_model(req.model)
    created = int(time.time())
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad_request(
            f"best_of must equal n ({n}): one sample is drawn per choice, got {req.best_of}", "best_of"
        )
    echo = bool(req.echo)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not echo:
        raise bad_request(
            "max_tokens must be >= 1 (0 is allowed with echo=true, to score the prompt)", "max_tokens"
        )
    score_only = echo and max_tokens == 0  # one token is generated to run the prefill, then dropped
    prompt_logprobs = req.logprobs if echo else None
    params = build_params(req, 1 if score_only else max_tokens, req.logprobs, prompt_logprobs=prompt_logprobs)
    explicit = "max_tokens" if req.max_tokens is not None else None
    prepared, prompt_tokens = await prepare_choices(
        state.intake, completion_prompts(req), params, explicit, echo, constraint_field(req)
    )
    table = await state.token_texts.table() if req.logprobs is not None else []
    echoed = _echo_of(prepared, req.logprobs is not None) if echo else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation.for_request(state, prepared, request_id, prompt_tokens, arrival, score_only)
    model = state.settings.served_model_name
    if req.stream:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        events = _events(gen, request_id, created, model, table, echoed, continuous)
        return EventStreamResponse(events, gen.close)
    try:
        results = await gen.collect(request)
    finally:
        gen.close()
    choices = []
    for index, r in enumerate(results):
        text, logprobs = r.text, None
        if echoed is not None:
            text = echoed.prompts[index] + text
            if echoed.with_logprobs:
                logprobs = echoed.logprobs(index, r.prompt_logprobs, table)
        if r.logprobs is not None:
            offset = len(echoed.prompts[index]) if echoed is not None else 0
            logprobs = completion_logprobs(r.token_ids, r.logprobs, table, offset, logprobs)
        choices.append(
            CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=r.finish_reason)
        )
    usage = gen.usage()
    body = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def _echo_of(prepared: list[PreparedRequest], with_logprobs: bool) -> _Echo:
    # One prepared request per choice, in choice order (n choices of the first prompt, then of the next).
    return _Echo([p.prompt or "" for p in prepared], [p.prompt_token_ids for p in prepared], with_logprobs)


async def _events(
    gen: Generation,
    request_id: str,
    created: int,
    model: str,
    table: list[str],
    echoed: _Echo | None,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    def chunk(choice: CompletionChoice) -> str:
        usage = gen.usage() if continuous_usage else None  # vLLM's stream_options.continuous_usage_stats
        return sse(
            CompletionResponse(
                id=request_id, created=created, model=model, choices=[choice], usage=usage
            ).model_dump()
        )

    # The hot path (a text delta, no logprobs): the same JSON as `chunk`, without building pydantic models.
    head = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def payload(index: object, text: object, usage: dict | None) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
        return {**head, "choices": [choice], "usage": usage}

    text_chunk = text_chunk_writer(payload, (lambda: gen.usage().model_dump()) if continuous_usage else None)

    offsets: dict[int, int] = {}
    echo_pending = set(range(len(echoed.prompts))) if echoed is not None else set()

    def echo_chunk(u: ChoiceUpdate) -> str:
        """The prompt, once, before the choice's first generated text."""
        echo_pending.discard(u.index)
        text = echoed.prompts[u.index]
        offsets[u.index] = len(text)
        logprobs = echoed.logprobs(u.index, u.prompt_logprobs, table) if echoed.with_logprobs else None
        return chunk(CompletionChoice(index=u.index, text=text, logprobs=logprobs))

    try:
        async for batch in gen.updates():
            events: list[str] = []  # one write per batch: whatever tokens were ready leave together
            for u in batch:
                if u.index in echo_pending and (u.prompt_logprobs is not None or not echoed.with_logprobs):
                    events.append(echo_chunk(u))
                if u.text and u.logprobs is None:
                    offsets[u.index] = offsets.get(u.index, 0) + len(u.text)
                    events.append(text_chunk(u.index, u.text))
                elif u.text or (
                    u.logprobs and u.token_ids
                ):  # logprobs keep their tokens even if text is held
                    logprobs = None
                    if u.logprobs is not None:
                        logprobs = completion_logprobs(
                            u.token_ids, u.logprobs, table, offsets.get(u.index, 0)
                        )
                    offsets[u.index] = offsets.get(u.index, 0) + len(u.text)
                    events.append(chunk(CompletionChoice(index=u.index, text=u.text, logprobs=logprobs)))
                if u.finish_reason is not None:
                    if u.index in echo_pending:  # finished before its prompt was scored (aborted)
                        events.append(echo_chunk(u))
                    events.append(
                        chunk(CompletionChoice(index=u.index, text="", finish_reason=u.finish_reason))
                    )
            if events:
                yield "".join(events)
                trace("api_written", int(any(u.finish_reason is not None for u in batch)))
        usage = gen.usage()
        final = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
        yield sse(final.model_dump()) + DONE
        return
    except OpenAIError as error:
        yield sse(error.body())
    yield DONE
