"""Read and validate a JSON request body ourselves, so every way it can be wrong is a 4xx in OpenAI's shape.

FastAPI's own body parsing answers 422 with `{"detail": [...]}` and reads bodies of any size.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from mlaserve.server.errors import OpenAIError, bad_request

M = TypeVar("M", bound=BaseModel)

# Past the limit we keep reading (and dropping) this much more before giving up on the connection, so that
# an honest client that sent a big body still reads our 413 instead of a reset socket.
_DRAIN_FACTOR = 8


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        await _drain(request, max_bytes * _DRAIN_FACTOR)
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                await _drain(request, max_bytes * _DRAIN_FACTOR)
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise OpenAIError(400, "the client disconnected while sending the body", status="aborted") from None
    return b"".join(chunks)


async def _drain(request: Request, limit: int) -> None:
    drained = 0
    try:
        async for chunk in request.stream():
            drained += len(chunk)
            if drained > limit:
                return
    except (ClientDisconnect, RuntimeError):  # RuntimeError: the stream was already consumed
        return


def _too_large(size: int, max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is {size} bytes or more; the limit is {max_bytes} bytes",
        code="body_too_large",
    )


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    if not text.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


def validate(model: type[M], body: dict) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(*_describe(e)) from None


_UNION_TAGS = {"str", "int", "float", "bool", "none"}
# Fields typed as unions, and the sentence that lists what they accept.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts {'type': 'text', 'text': ...}",
}


def _describe(error: ValidationError) -> tuple[str, str | None]:
    """One message naming the field: union members and list indexes are dropped from pydantic's loc."""
    first = error.errors()[0]
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part and not part[:1].isupper():  # not a union member
            path += f".{part}" if path else part
    path = path or param
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if first["type"] == "missing":
        return f"'{path}' is required", param
    if first["type"] == "extra_forbidden":
        return f"'{path}' is not supported by this server", param
    union = next((part for part in loc if isinstance(part, str) and part in _UNION_HINTS), None)
    if union is not None and len(error.errors()) > 1:  # one error per union member: say what was allowed
        return f"invalid '{path}': must be {_UNION_HINTS[union]} (got {shown})", param
    return f"invalid '{path}': {first['msg'].lower()} (got {shown})", param
