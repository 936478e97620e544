"""DeepSeek-V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`.

As the V3.1 chat template renders calls: the same block tokens as V3 but the name before the separator and the
arguments JSON right after it, with no type, fence or newline, and nothing between consecutive calls.
"""

from __future__ import annotations

from mlaserve.tool_calls.block import BlockFormat
from mlaserve.tool_calls.deepseek_tokens import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from mlaserve.tool_calls.json_args import json_object_text


def read_v31_call(inner: str) -> tuple[str, str] | None:
    name, sep, arguments = inner.partition(TOOL_SEP)
    if not sep or not name.strip():
        return None
    text = json_object_text(arguments)
    return None if text is None else (name.strip(), text)


DEEPSEEK_V31 = BlockFormat(TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, read_v31_call)
