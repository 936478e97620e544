"""Formats whose calls sit between begin and end markers, optionally grouped in a block with its own markers.

This covers DeepSeek's special-token formats, the DSML markup and Hermes' <tool_call> tags: only the markers
and how one call's inner text reads differ, so each format is a BlockFormat and one stream walks them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlaserve.tool_calls.stream import ToolCallStream, partial_suffix_len
from mlaserve.tool_calls.types import IdFactory

# The inner text of one call (between call_start and call_end) to (name, arguments JSON), or None if malformed.
CallReader = Callable[[str], "tuple[str, str] | None"]


@dataclass(frozen=True)
class BlockFormat:
    """block_start opens a run of calls; block_end closes it, or None where the run simply stops at the first
    text that is not a call (Hermes, whose block_start is then the call_start itself)."""

    block_start: str
    block_end: str | None
    call_start: str
    call_end: str
    read_call: CallReader


_TEXT, _BLOCK, _FALLBACK = "text", "block", "fallback"


class BlockStream(ToolCallStream):
    def __init__(self, fmt: BlockFormat, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._fmt = fmt
        self._state = _TEXT
        # Whitespace between the content and a block: templates put a newline or a blank line there, which is
        # layout rather than content; it is given back if the block turns out malformed.
        self._pre_ws = ""
        self._cursor = 0  # where in _buf the next element of the block starts
        self._calls_in_block = 0
        # How far into the pending call the end marker is known absent, so a long call arriving in many small
        # deltas is searched once rather than from its start on every delta.
        self._searched = 0

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == _TEXT:
                moved = self._in_text(final)
            elif self._state == _BLOCK:
                moved = self._in_block(final)
            else:
                self._content(self._buf)
                self._buf = ""
                moved = False
            if not moved:
                return

    def _in_text(self, final: bool) -> bool:
        fmt, buf = self._fmt, self._buf
        i = buf.find(fmt.block_start)
        if i >= 0:
            before = buf[:i]
            kept = before.rstrip()
            self._content(kept)
            self._pre_ws = before[len(kept) :]
            self._buf = buf[i:]
            self._cursor = 0 if fmt.block_start == fmt.call_start else len(fmt.block_start)
            self._calls_in_block = 0
            self._searched = 0
            self._state = _BLOCK
            return True
        if final:
            self._content(buf)
            self._buf = ""
            return False
        # Hold a possible start of the marker, and the whitespace before it, which is dropped if a block follows.
        j = len(buf) - partial_suffix_len(buf, fmt.block_start)
        while j > 0 and buf[j - 1].isspace():
            j -= 1
        self._content(buf[:j])
        self._buf = buf[j:]
        return False

    def _in_block(self, final: bool) -> bool:
        fmt = self._fmt
        rest = self._buf[self._cursor :]
        body = rest.lstrip()
        if body.startswith(fmt.call_start):
            end = body.find(fmt.call_end, max(len(fmt.call_start), self._searched))
            if end < 0:
                self._searched = max(len(body) - len(fmt.call_end) + 1, 0)
                return self._fail() if final else False
            parsed = fmt.read_call(body[len(fmt.call_start) : end])
            if parsed is None:
                return self._fail()
            self._call(*parsed)
            self._calls_in_block += 1
            self._buf = body[end + len(fmt.call_end) :]
            self._cursor = 0
            self._searched = 0
            return True
        if fmt.block_end is not None and body.startswith(fmt.block_end):
            if self._calls_in_block == 0:
                return self._fail()
            self._buf = body[len(fmt.block_end) :]
            self._state = _TEXT
            return True
        could_grow = fmt.call_start.startswith(body) or (fmt.block_end or "").startswith(body)
        if not final and could_grow:
            return False
        if self._calls_in_block > 0 and not body:
            # The reply ended after whole calls (the block's end marker may be missing when generation stops at
            # EOS): the calls stand and the trailing whitespace is layout.
            self._buf = ""
            self._state = _TEXT
            return False
        if fmt.block_end is None and self._calls_in_block > 0:
            # A Hermes run of calls ends at the first other text, which is content again.
            self._state = _TEXT
            return True
        return self._fail()

    def _fail(self) -> bool:
        # Everything from the element that did not parse on is content (from the block's own marker where no
        # call of it was released), so nothing the model wrote is lost.
        if self._calls_in_block == 0:
            self._buf = self._pre_ws + self._buf
        self._pre_ws = ""
        self._state = _FALLBACK
        return True
