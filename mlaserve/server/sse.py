"""Server-sent events that notice a client leaving at once, and always run their clean-up.

Starlette's StreamingResponse (ASGI 2.4 servers) learns of a disconnect only when a send fails, i.e. not while
a request waits in the engine queue, and it never closes the body iterator. Here a watcher task reads
`http.disconnect` and cancels the stream, and `on_close` runs however the response ends (even if the
iterator never started).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
INDEX_SLOT, TEXT_SLOT = "\x00index", "\x00text"  # the slots of a text chunk's sse_template


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_template(payload: dict, *slots: str) -> Callable[..., str]:
    """`sse` for a payload whose values equal to `slots` change per event: the rest of the JSON is encoded once,
    each event encodes only its values. A stream's text chunks differ only in their index and text, and encoding
    the whole chunk each event was a tenth of an API server's time. The slots must come in the order the JSON
    meets them, after every string the client chose (model name, ids): each is found from the end."""
    rest = json.dumps(payload, ensure_ascii=False)
    pieces = []
    for slot in reversed(slots):
        rest, after = rest.rsplit(json.dumps(slot, ensure_ascii=False), 1)
        pieces.append(after)
    pieces.append(rest)
    pieces.reverse()

    def fill(*values: object) -> str:
        out = ["data: ", pieces[0]]
        for value, piece in zip(values, pieces[1:], strict=True):
            out += (json.dumps(value, ensure_ascii=False), piece)
        out.append("\n\n")
        return "".join(out)

    return fill


def text_chunk_writer(
    payload: Callable[[object, object, dict | None], dict], usage: Callable[[], dict] | None
) -> Callable[[int, str], str]:
    """The streaming hot path's text event, (choice index, text) -> SSE text: payload(index, text, usage) gives
    its JSON. Without per-event usage (`usage` None) it comes from a template; with it, each is encoded whole."""
    if usage is None:
        return sse_template(payload(INDEX_SLOT, TEXT_SLOT, None), INDEX_SLOT, TEXT_SLOT)
    return lambda index, text: sse(payload(index, text, usage()))


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._close_callbacks = [on_close]

    def on_close(self, callback: Callable[[], None]) -> None:
        """Also run `callback` when the stream ends, however it ends."""
        self._close_callbacks.append(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                for callback in self._close_callbacks:
                    callback()
