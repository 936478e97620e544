"""Value types of parsed tool calls, in the shapes of OpenAI's chat API (whole message and streaming delta)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

IdFactory = Callable[[], str]


def make_tool_call_id() -> str:
    """A fresh call id; random so that ids from concurrent requests never collide in a client's history."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call. arguments is JSON text of an object, as OpenAI sends it (a string, not a dict)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call in a stream. OpenAI clients take id, type and name from a call's first delta only and
    concatenate the arguments of all deltas with the same index, so later deltas leave those fields None."""

    index: int
    arguments: str = ""
    id: str | None = None
    type: Literal["function"] | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        out["function"] = function
        return out


@dataclass
class ParseResult:
    """A whole reply split into text for the user and tool calls; content is "" where there is none (the server
    decides whether that becomes null)."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What one fed chunk released: content text and call pieces. Either may be empty: text that could still turn
    out to be markup is held back until it is decided."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def collect(deltas: Iterable[StreamDelta]) -> ParseResult:
    """Joins a stream's deltas the way an OpenAI client does: content concatenated, calls gathered by index."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": []})
            if piece.id is not None:
                call["id"] = piece.id
            if piece.name is not None:
                call["name"] = piece.name
            call["arguments"].append(piece.arguments)
    return ParseResult(
        content="".join(content),
        tool_calls=[
            ToolCall(id=c["id"] or "", name=c["name"] or "", arguments="".join(c["arguments"]))
            for _, c in sorted(calls.items())
        ],
    )
