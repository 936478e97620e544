"""Read and validate a JSON request body ourselves, so every way it can be wrong is a 4xx in OpenAI's shape.

FastAPI's own body parsing answers 422 with `{"detail": [...]}` and reads bodies of any size.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from mlaserve.server.errors import OpenAIError, bad_request

M = TypeVar("M", bound=BaseModel)

# Past the limit we keep reading (and dropping) this much more before giving up on the connection, so that
# an honest client that sent a big body still reads our 413 instead of a reset socket.
_DRAIN_FACTOR = 8


async def read_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The whole body, or a 413 past max_bytes, or a 408 when it did not all arrive within timeout_s (a client
    trickling its body must not hold the connection, nor anything else, for long)."""
    if timeout_s is None:
        return await _read_body(request, max_bytes)
    try:
        return await asyncio.wait_for(_read_body(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        raise OpenAIError(
            408,
            f"the request body did not arrive within body_timeout_s={timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
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


def check_json_content_type(header: str | None) -> None:
    """A 415 unless the body is declared as JSON: a form post (curl -d's default) or text/plain from a browser page
    must not reach the JSON parser as if it were an API call. Any charset but UTF-8 is refused too, since the body
    is decoded as UTF-8."""
    media, *params = (part.strip().lower() for part in (header or "").split(";"))
    charset = next((p.partition("=")[2].strip('" ') for p in params if p.startswith("charset=")), "utf-8")
    if media == "application/json" and charset == "utf-8":
        return
    given = f"'{header[:100]}'" if header else "none"
    raise OpenAIError(
        415,
        f"the request body must be sent with 'Content-Type: application/json' (got {given})",
        code="unsupported_media_type",
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
    # The body was decoded from strict UTF-8, which cannot hold a surrogate: only a \uD800-\uDFFF escape can spell
    # one, so a body without such an escape (a prompt of token ids, most text) skips the walk over every value.
    bad = _lone_surrogate(body) if _SURROGATE_ESCAPE.search(text) else None
    if bad is not None:
        path, char = bad
        field = _path_text(path)
        raise bad_request(
            f"'{field}' contains a lone UTF-16 surrogate (U+{ord(char):04X}), which is not valid Unicode text",
            _escape(str(path[0])) if path else None,
            "invalid_unicode",
        )
    return body


def sequences_asked(body: dict) -> int:
    """How many sequences a generation body asks for (prompts x max(n, best_of)), read loosely before validation:
    a malformed field counts as 1 and is rejected by validation later."""

    def count(name: str) -> int:
        value = body.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1

    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return prompts * max(count("n"), count("best_of"))


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(body: dict) -> tuple[tuple, str] | None:
    """(path, the character) of the first string (value or key) holding a lone surrogate: JSON's \\uXXXX escapes
    can spell one, Python keeps it, and no tokenizer or UTF-8 encoder accepts it. Iterative: a body nested as
    deep as json.loads allows must not overflow the stack here."""
    stack: list[tuple[tuple, object]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                return path, found.group()
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack.append((path + (key,), item))
                stack.append((path + (key,), key))
        elif isinstance(value, list):
            stack.extend((path + (i,), item) for i, item in reversed(list(enumerate(value))))
    return None


def _escape(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _path_text(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return _escape(text) or "the body"


def validate(model: type[M], body: dict, where: str = "") -> M:
    """`where`: the path of `body` inside the request (input[2]), for a member validated on its own."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(*_describe(e, where)) from None


_UNION_TAGS = {"str", "int", "float", "bool", "none"}
# Fields typed as unions, and the sentence that lists what they accept.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts {'type': 'text', 'text': ...}",
    "input": "a string or a list of input items",  # /v1/responses
}


def _describe(error: ValidationError, where: str = "") -> tuple[str, str | None]:
    """One message naming the field: union members and list indexes are dropped from pydantic's loc."""
    first = error.errors()[0]
    loc = first["loc"]
    param = where or (str(loc[0]) if loc else None)
    path = where
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _UNION_TAGS and "[" not in part and not part[:1].isupper():  # not a union member
            path += f".{part}" if path else part
    path = path or param
    if where:  # a member checked on its own is named whole: input[2].call_id
        param = path
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
