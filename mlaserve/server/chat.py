"""POST /v1/chat/completions: the model's chat template, then the same generation path as completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.engine.step_trace import trace
from mlaserve.server.body import validate
from mlaserve.server.chat_output import (
    ChatDelta,
    ChoiceParser,
    OutputParsing,
    needs_special_tokens,
    prompt_opens_reasoning,
)
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.generation import ChoiceUpdate, Generation
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
from mlaserve.server.tools import tool_mode, validate_tools
from mlaserve.tool_calls import StreamDelta, collect


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its generation, how its choices' text is read, and its ids.
    /v1/responses runs through this too, so both endpoints share the template, tools, grammars and limits."""

    req: ChatCompletionRequest
    gen: Generation
    parsing: OutputParsing
    num_choices: int
    request_id: str
    created: int
    model: str
    top: int | None
    table: list[str]


async def start_chat(
    state: ServerState, req: ChatCompletionRequest, arrival: float, request_id: str
) -> ChatRun:
    """Raises a 400 naming the field for anything the request cannot have, before the engine sees it."""
    state.check_model(req.model)
    created = int(time.time())
    if not req.messages:
        raise bad_request("messages must be a non-empty list of chat messages", "messages")
    max_tokens, field = chat_max_tokens(req)
    top = requested_logprobs(req)
    mode = tool_mode(req, validate_tools(req.tools), state.parsers.tool and state.parsers.tool.name)
    tool_parser = state.parsers.tool if mode.kind == "auto" else None
    keep_special = needs_special_tokens(tool_parser)
    parallel = (req.model_extra or {}).get("parallel_tool_calls") is not False
    tool_grammar = mode.grammar(parallel)
    params = build_params(
        req, max_tokens, top, field, tool_grammar=tool_grammar, keep_special_tokens=keep_special
    )
    grammar_field = "tools" if tool_grammar is not None else constraint_field(req)
    prepared, prompt_tokens = await prepare_choices(
        state.intake, req, params, field, grammar_field=grammar_field
    )
    tokenizer = state.intake.tokenizer
    parsing = OutputParsing(
        mode,
        tool_parser,
        state.parsers.reasoning,
        prompt_opens_reasoning(prepared[0].prompt),
        getattr(tokenizer, "eos_token", None) if params[0].skip_special_tokens is False else None,
    )
    table = await state.token_texts.table() if top is not None else []
    gen = Generation.for_request(state, prepared, request_id, prompt_tokens, arrival)
    model = state.settings.served_model_name
    return ChatRun(req, gen, parsing, len(prepared), request_id, created, model, top, table)


async def create_chat_completion(
    state: ServerState, request: Request, body: dict, arrival: float
) -> Response:
    req = validate(ChatCompletionRequest, body)
    run = await start_chat(state, req, arrival, f"chatcmpl-{uuid.uuid4().hex}")
    gen, parsing, top, table = run.gen, run.parsing, run.top, run.table
    request_id, created, model = run.request_id, run.created, run.model
    if req.stream:
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        events = _events(
            gen, run.num_choices, request_id, created, model, table, top or 0, continuous, parsing
        )
        return EventStreamResponse(events, gen.close)
    try:
        results = await gen.collect(request)
    finally:
        gen.close()
    choices = []
    for index, r in enumerate(results):
        message, finish_reason = _message(parsing, r.text, r.finish_reason)
        logprobs = None if r.logprobs is None else chat_logprobs(r.token_ids, r.logprobs, table, top or 0)
        choices.append(
            ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason)
        )
    usage = gen.usage()
    response = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


def _message(
    parsing: OutputParsing, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    if not parsing.active:
        return AssistantMessage(content=text), finish_reason
    parser = parsing.choice()
    delta = parser.feed(text, final=True)
    calls = collect([StreamDelta(tool_calls=delta.tool_calls)]).tool_calls
    message = AssistantMessage(
        content=delta.content if delta.content or not calls else None,
        reasoning_content=delta.reasoning or None,
        tool_calls=[c.to_openai() for c in calls] or None,
    )
    return message, parser.finish_reason(finish_reason)


def _parsed_delta(delta: ChatDelta) -> Delta | None:
    if not (delta.content or delta.reasoning or delta.tool_calls):
        return None
    return Delta(
        content=delta.content or None,
        reasoning_content=delta.reasoning or None,
        tool_calls=[c.to_openai() for c in delta.tool_calls] or None,
    )


async def _events(
    gen: Generation,
    num_choices: int,
    request_id: str,
    created: int,
    model: str,
    table: list[str],
    top: int,
    continuous_usage: bool = False,
    parsing: OutputParsing | None = None,
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
    parsers = (
        [parsing.choice() for _ in range(num_choices)] if parsing is not None and parsing.active else None
    )

    try:
        # OpenAI opens each choice with the role, before any token.
        yield "".join(
            chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")))
            for i in range(num_choices)
        )
        async for batch in gen.updates():
            events: list[str] = []  # one write per batch: whatever tokens were ready leave together
            for u in batch:
                if parsers is not None:
                    events += _parsed_events(parsers[u.index], u, chunk, table, top)
                    continue
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


def _parsed_events(
    parser: ChoiceParser, u: ChoiceUpdate, chunk: Callable[[ChatChunkChoice], str], table: list[str], top: int
) -> list[str]:
    """A choice's update read through its parsers: what they released (text that may still be markup waits),
    then its end with OpenAI's finish_reason."""
    final = u.finish_reason is not None
    delta = _parsed_delta(parser.feed(u.text, final))
    logprobs = None if u.logprobs is None else chat_logprobs(u.token_ids, u.logprobs, table, top)
    events = []
    if delta is not None or (u.logprobs and u.token_ids):
        events.append(chunk(ChatChunkChoice(index=u.index, delta=delta or Delta(), logprobs=logprobs)))
    if final:
        reason = parser.finish_reason(u.finish_reason)
        events.append(chunk(ChatChunkChoice(index=u.index, delta=Delta(), finish_reason=reason)))
    return events
