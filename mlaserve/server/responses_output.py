"""A reply's parsed pieces (reasoning, text, tool-call deltas) as Responses output items, and the stream events
that build them.

The whole response and the stream come from this one builder (the whole reply is one delta), so the items a
streaming client assembles are the items of the plain response. Each kind of piece opens its own item, and a
piece of another kind closes the open one: reasoning, then a message, then one item per function call.
"""

from __future__ import annotations

import uuid

from mlaserve.server.chat_output import ChatDelta
from mlaserve.server.responses_protocol import (
    FunctionCallOutput,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningContent,
    ReasoningItem,
)
from mlaserve.tool_calls import ToolCallDelta

Event = dict  # one stream event without its sequence_number (the writer numbers them)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._call_index: int | None = None  # the tool call (the parser's index) the open function_call is
        # Blank text between items (a parser's newline after a call) waits: it opens a message only once text
        # that is not blank follows, so a reply of calls has no empty message items.
        self._blank = ""

    def feed(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for piece in delta.tool_calls:
            events += self._call(piece)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Closes the open item (incomplete when the output was cut by max_output_tokens); a reply with no item
        at all still gets its (maybe empty) message, as OpenAI's responses always carry one."""
        events = [] if self.items else self._text(self._blank, force=True)
        self._blank = ""
        return events + self._close("incomplete" if incomplete else "completed")

    # ---- one kind of piece each ------------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if not isinstance(item, ReasoningItem):
            events += self._close("completed")
            item = ReasoningItem(id=_item_id("rs"), content=[], status="in_progress")
            events += self._start(item)
            item.content.append(ReasoningContent(text=""))
            events.append(self._part_event("response.content_part.added", item))
        item.content[0].text += text
        events.append(self._event("response.reasoning_text.delta", item, content_index=0, delta=text))
        return events

    def _text(self, text: str, force: bool = False) -> list[Event]:
        item = self._open
        if not isinstance(item, MessageItem):
            if not text.strip() and not force:
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
        events: list[Event] = []
        if not isinstance(item, MessageItem):
            events += self._close("completed")
            item = MessageItem(id=_item_id("msg"), content=[], status="in_progress")
            events += self._start(item)
            item.content.append(OutputText(text=""))
            events.append(self._part_event("response.content_part.added", item))
        item.content[0].text += text
        events.append(
            self._event("response.output_text.delta", item, content_index=0, delta=text, logprobs=[])
        )
        return events

    def _call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if (
            piece.name is not None
            or self._call_index != piece.index
            or not isinstance(item, FunctionCallOutput)
        ):
            events += self._close("completed")
            self._blank = ""
            item = FunctionCallOutput(
                id=_item_id("fc"),
                call_id=piece.id or f"call_{uuid.uuid4().hex[:24]}",
                name=piece.name or "",
                arguments="",
                status="in_progress",
            )
            self._call_index = piece.index
            events += self._start(item)
        if piece.arguments:
            item.arguments += piece.arguments
            events.append(self._event("response.function_call_arguments.delta", item, delta=piece.arguments))
        return events

    # ---- item life ------------------------------------------------------------------------------------------
    def _start(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [self._item_event("response.output_item.added", item)]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open, self._call_index = None, None
        item.status = status
        events: list[Event] = []
        if isinstance(item, MessageItem):
            text = item.content[0].text
            events.append(
                self._event("response.output_text.done", item, content_index=0, text=text, logprobs=[])
            )
            events.append(self._part_event("response.content_part.done", item))
        elif isinstance(item, ReasoningItem):
            text = item.content[0].text
            events.append(self._event("response.reasoning_text.done", item, content_index=0, text=text))
            events.append(self._part_event("response.content_part.done", item))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done", item, arguments=item.arguments, name=item.name
                )
            )
        events.append(self._item_event("response.output_item.done", item))
        return events

    def _index(self, item: OutputItem) -> int:
        return next(i for i, other in enumerate(self.items) if other is item)

    def _item_event(self, kind: str, item: OutputItem) -> Event:
        return {"type": kind, "output_index": self._index(item), "item": item.model_dump()}

    def _event(self, kind: str, item: OutputItem, **fields: object) -> Event:
        return {"type": kind, "item_id": item.id, "output_index": self._index(item), **fields}

    def _part_event(self, kind: str, item: MessageItem | ReasoningItem) -> Event:
        return self._event(kind, item, content_index=0, part=item.content[0].model_dump())
