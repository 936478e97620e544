"""POST /v1/responses (OpenAI's Responses API, stateless): the request is run as the chat request it means, and
the chat parsers' pieces come back as output items, whole or as the API's typed stream events."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.server.body import validate
from mlaserve.server.chat import ChatRun, start_chat
from mlaserve.server.chat_output import ChatDelta, ChoiceParser
from mlaserve.server.errors import OpenAIError
from mlaserve.server.responses_input import chat_request, responses_error
from mlaserve.server.responses_output import Event, OutputItems
from mlaserve.server.responses_protocol import (
    IncompleteDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from mlaserve.server.sse import EventStreamResponse
from mlaserve.server.state import ServerState


async def create_response(state: ServerState, request: Request, body: dict, arrival: float) -> Response:
    req = validate(ResponsesRequest, body)
    chat = chat_request(req)
    try:
        run = await start_chat(state, chat, arrival, f"resp_{uuid.uuid4().hex}")
    except OpenAIError as error:
        raise responses_error(error) from None
    response = _opened(req, run)
    if req.stream:
        return EventStreamResponse(_events(run, response), run.gen.close)
    try:
        results = await run.gen.collect(request)
    finally:
        run.gen.close()
    result = results[0]
    items = OutputItems()
    items.feed(_read(_parser(run), result.text, final=True))
    items.finish(result.finish_reason == "length")
    _close(response, run, items, result.finish_reason)
    return JSONResponse(response.model_dump())


def _opened(req: ResponsesRequest, run: ChatRun) -> ResponseObject:
    """The response as the stream's first events show it: the request's settings echoed, no output yet."""
    extra = req.model_extra or {}
    text_format = req.text.format if req.text and req.text.format else None
    echoed = (
        {"text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)}} if text_format else {}
    )
    return ResponseObject(
        id=run.request_id,
        created_at=run.created,
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=run.model,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
        temperature=1.0 if req.temperature is None else req.temperature,
        tool_choice=req.tool_choice or run.parsing.mode.kind,
        tools=req.tools or [],
        top_p=1.0 if req.top_p is None else req.top_p,
        metadata=extra.get("metadata"),
        user=extra.get("user"),
        **echoed,
    )


def _close(response: ResponseObject, run: ChatRun, items: OutputItems, finish_reason: str | None) -> None:
    usage = run.gen.usage()
    response.output = items.items
    response.usage = ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    else:
        response.status = "completed"


def _parser(run: ChatRun) -> ChoiceParser | None:
    return run.parsing.choice() if run.parsing.active else None


def _read(parser: ChoiceParser | None, text: str, final: bool) -> ChatDelta:
    return ChatDelta(content=text) if parser is None else parser.feed(text, final)


async def _events(run: ChatRun, response: ResponseObject) -> AsyncIterator[str]:
    numbers = itertools.count()

    def write(event: Event) -> str:
        kind = event["type"]
        data = json.dumps({"type": kind, "sequence_number": next(numbers), **event}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def lifecycle(kind: str) -> str:
        return write({"type": kind, "response": response.model_dump()})

    parser = _parser(run)
    items = OutputItems()
    finish_reason: str | None = None
    flushed = False
    try:
        yield lifecycle("response.created") + lifecycle("response.in_progress")
        async for batch in run.gen.updates():
            events: list[Event] = []
            for update in batch:  # one choice: Responses has no n
                final = update.finish_reason is not None
                events += items.feed(_read(parser, update.text, final))
                flushed = flushed or final
                finish_reason = update.finish_reason or finish_reason
            if events:
                yield "".join(write(e) for e in events)
        closing = [] if flushed else items.feed(_read(parser, "", final=True))
        closing += items.finish(finish_reason == "length")
        _close(response, run, items, finish_reason)
        # OpenAI ends a response cut by max_output_tokens with response.incomplete, not response.completed.
        yield "".join(write(e) for e in closing) + lifecycle(f"response.{response.status}")
    except OpenAIError as error:
        yield write({"type": "error", "code": error.code, "message": error.message, "param": error.param})
