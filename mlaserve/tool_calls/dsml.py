"""DSML, DeepSeek's XML-like tool markup (V3.2 and V4), as DeepSeek's Python encoders render it:

    <｜DSML｜function_calls>                      (V4: <｜DSML｜tool_calls>)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Each argument is its own parameter: string="true" carries a string verbatim (no JSON quoting or escaping),
string="false" any other value as JSON. Lines are joined by single newlines.

Sources: V3.2's encoder is DeepSeek's encoding/encoding_dsv32.py (also vendored in vLLM). V4's was read in copies
of DeepSeek's release (encoding/encoding_dsv4.py with its golden test files) and in sglang's; the prompt encoders in
mlaserve/server/encoders/ reproduce both byte for byte. Some of those copies also carry a later encoder whose tag names begin with a space
("< calls>", "< invoke>", "< parameter>" after the DSML token); that variant is not confirmed and not parsed.
"""

from __future__ import annotations

import json
import re

from mlaserve.tool_calls.block import BlockFormat
from mlaserve.tool_calls.deepseek_tokens import DSML
from mlaserve.tool_calls.json_args import dump_arguments

_INVOKE_HEAD = re.compile(r'\s+name="([^"]+)"\s*>')
_PARAM_HEAD = re.compile(re.escape(f"<{DSML}parameter") + r'\s+name="([^"]+)"\s+string="(true|false)"\s*>')
_PARAM_END = f"</{DSML}parameter>"


def read_dsml_invoke(inner: str) -> tuple[str, str] | None:
    """inner is the text after `<｜DSML｜invoke` up to the invoke's end tag."""
    head = _INVOKE_HEAD.match(inner)
    if head is None:
        return None
    arguments: dict = {}
    pos = head.end()
    while True:
        while pos < len(inner) and inner[pos].isspace():
            pos += 1
        if pos == len(inner):
            return head.group(1), dump_arguments(arguments)
        param = _PARAM_HEAD.match(inner, pos)
        if param is None:
            return None
        end = inner.find(_PARAM_END, param.end())
        if end < 0:
            return None
        raw = inner[param.end() : end]
        if param.group(2) == "true":
            arguments[param.group(1)] = raw
        else:
            try:
                arguments[param.group(1)] = json.loads(raw)
            except ValueError:
                # The encoder writes non-strings as JSON, so anything else is a malformed call.
                return None
        pos = end + len(_PARAM_END)


def _dsml_format(block_name: str) -> BlockFormat:
    return BlockFormat(
        block_start=f"<{DSML}{block_name}>",
        block_end=f"</{DSML}{block_name}>",
        call_start=f"<{DSML}invoke",
        call_end=f"</{DSML}invoke>",
        read_call=read_dsml_invoke,
    )


DEEPSEEK_V32 = _dsml_format("function_calls")
# V4's encoder keeps V3.2's invoke and parameter tags and renames the block to tool_calls.
DEEPSEEK_V4 = _dsml_format("tool_calls")
