"""A named tool-call format: whole-reply parsing and fresh streams for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlaserve.tool_calls.stream import ToolCallStream, parse_whole
from mlaserve.tool_calls.types import IdFactory, ParseResult, make_tool_call_id

StreamFactory = Callable[[IdFactory], ToolCallStream]


@dataclass(frozen=True)
class ToolParser:
    """parse() is a stream fed the whole reply at once, so a streamed reply and a whole one agree by
    construction wherever the format's steps are split-independent (which the tests check at every split)."""

    name: str
    make_stream: StreamFactory
    id_factory: IdFactory = field(default=make_tool_call_id)

    def stream(self) -> ToolCallStream:
        """A fresh stream for one reply (one per choice of a request)."""
        return self.make_stream(self.id_factory)

    def parse(self, text: str) -> ParseResult:
        return parse_whole(self.stream(), text)
