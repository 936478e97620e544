"""DeepSeek-V3 and R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence.

As the V3/R1 chat template renders an assistant turn's calls: the calls between TOOL_CALLS_BEGIN and
TOOL_CALLS_END, one newline between calls, each call's type ("function") before the separator, the name after
it, then a newline and the arguments fenced as a json code block.
"""

from __future__ import annotations

import re

from mlaserve.tool_calls.block import BlockFormat
from mlaserve.tool_calls.deepseek_tokens import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)
from mlaserve.tool_calls.json_args import json_object_text

_FENCED = re.compile(r"```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def read_v3_call(inner: str) -> tuple[str, str] | None:
    kind, sep, rest = inner.partition(TOOL_SEP)
    # The template writes the OpenAI call type here, which is always "function".
    if not sep or kind.strip() != "function":
        return None
    name, newline, fenced = rest.partition("\n")
    match = _FENCED.fullmatch(fenced)
    if not newline or not name.strip() or match is None:
        return None
    arguments = json_object_text(match.group(1))
    return None if arguments is None else (name.strip(), arguments)


DEEPSEEK_V3 = BlockFormat(TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, read_v3_call)
