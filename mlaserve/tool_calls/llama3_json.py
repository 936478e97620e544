"""Llama 3.1/3.2 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several calls separated by ";".

There is no end marker, so whether a reply is calls is known only at its end: a reply that starts like one
(`{` or the python tag, after whitespace) is held until finish(); any other reply streams as content at once.
"""

from __future__ import annotations

import json

from mlaserve.tool_calls.hermes import name_and_arguments
from mlaserve.tool_calls.stream import ToolCallStream

PYTHON_TAG = "<|python_tag|>"


def read_llama_calls(text: str) -> list[tuple[str, str]] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = name_and_arguments(value)
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1


class Llama3JsonStream(ToolCallStream):
    _UNDECIDED, _HOLD, _CONTENT = "undecided", "hold", "content"

    def __init__(self, id_factory) -> None:
        super().__init__(id_factory)
        self._state = self._UNDECIDED

    def _advance(self, final: bool) -> None:
        if self._state == self._UNDECIDED:
            head = self._buf.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._state = self._HOLD
            elif head and not PYTHON_TAG.startswith(head):
                self._state = self._CONTENT
            elif not final:
                return
        if self._state == self._HOLD and final:
            calls = read_llama_calls(self._buf)
            if calls is not None:
                for name, arguments in calls:
                    self._call(name, arguments)
                self._buf = ""
                return
        if self._state != self._HOLD or final:
            self._content(self._buf)
            self._buf = ""
