"""The incremental parser every format builds on: text in, decided content and whole calls out.

A reply is parsed by feeding it in one piece and finishing, so a stream fed the same text in any split gives the
same content and calls provided each format's steps decide only from the text they have seen and wait whenever
more text could change the decision. Calls are released only once they are closed and valid: a call that never
closes, or does not parse, becomes content, and a delta already sent cannot be taken back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from mlaserve.tool_calls.types import IdFactory, ParseResult, StreamDelta, ToolCallDelta, collect


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker: the part to hold back because the
    next chunk may complete the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream(ABC):
    """Feed text deltas, then finish once; each call returns what became decided."""

    def __init__(self, id_factory: IdFactory) -> None:
        self._id_factory = id_factory
        self._buf = ""
        self._n_calls = 0
        self._finished = False
        self._out = StreamDelta()

    def feed(self, text: str) -> StreamDelta:
        if self._finished:
            raise ValueError("feed() after finish(): a stream parses one reply")
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """Flushes what was held back: the end of the reply decides every open question."""
        if self._finished:
            return StreamDelta()
        self._finished = True
        self._advance(final=True)
        return self._take()

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Consumes as much of self._buf as can be decided (all of it when final), through _content and _call."""

    def _content(self, text: str) -> None:
        self._out.content += text

    def _call(self, name: str, arguments: str) -> None:
        # Name first with empty arguments, then the arguments: the shape OpenAI streams, which clients expect.
        index = self._n_calls
        self._n_calls += 1
        self._out.tool_calls.append(
            ToolCallDelta(index=index, id=self._id_factory(), type="function", name=name, arguments="")
        )
        self._out.tool_calls.append(ToolCallDelta(index=index, arguments=arguments))

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out


def parse_whole(stream: ToolCallStream, text: str) -> ParseResult:
    return collect([stream.feed(text), stream.finish()])
