"""Output written under tools.py's grammar for `required` and a named function, read back as tool calls.

The grammar fixes the text's shape, so these streams only need to find where each call's arguments begin and end:
a named call's whole output is its arguments; `required` writes [{"name": "...", "arguments": {...}}, ...]. The
arguments stream out as they are generated, as OpenAI streams them, rather than waiting for each call to close.
"""

from __future__ import annotations

import json
import re

from mlaserve.tool_calls.stream import ToolCallStream
from mlaserve.tool_calls.types import IdFactory, ToolCallDelta

# The start of one call of the array (after the previous call's closing brace), up to where its arguments begin;
# whitespace is allowed although the grammar writes none, so text written by other means still reads.
_CALL_HEAD = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class NamedCallStream(ToolCallStream):
    """The whole output is the arguments of one call to `name`."""

    def __init__(self, name: str, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._name = name
        self._opened = False

    def _advance(self, final: bool) -> None:
        if not self._opened:
            self._opened = True
            self._out.tool_calls.append(
                ToolCallDelta(index=0, id=self._id_factory(), type="function", name=self._name)
            )
            self._n_calls = 1
        if self._buf:
            self._out.tool_calls.append(ToolCallDelta(index=0, arguments=self._buf))
            self._buf = ""


class RequiredCallsStream(ToolCallStream):
    """A JSON array of {"name", "arguments"} objects: each call's name once its string closes, then its
    arguments piece by piece up to the brace that closes them."""

    def __init__(self, id_factory: IdFactory) -> None:
        super().__init__(id_factory)
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def _advance(self, final: bool) -> None:
        while self._buf:
            if not self._in_args:
                head = _CALL_HEAD.match(self._buf)
                if head is None:
                    # the closing "}]" and anything the grammar did not write; held until the stream ends
                    if final:
                        self._buf = ""
                    return
                index = self._n_calls
                self._n_calls += 1
                name = json.loads(head.group(1))
                self._out.tool_calls.append(
                    ToolCallDelta(index=index, id=self._id_factory(), type="function", name=name)
                )
                self._buf = self._buf[head.end() :]
                self._in_args, self._depth = True, 0
                continue
            if self._depth == 0:  # blanks before the arguments' value may arrive after the head matched
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return
            end = self._scan()
            piece, self._buf = self._buf[:end], self._buf[end:]
            if piece:
                self._out.tool_calls.append(ToolCallDelta(index=self._n_calls - 1, arguments=piece))
            if self._in_args:  # the arguments go on in text not generated yet
                return

    def _scan(self) -> int:
        """How much of the buffer belongs to the current arguments; leaves _in_args once their value closes."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_args = False
                    return i + 1
        return len(self._buf)
