"""Pieces both DeepSeek encoders share: special tokens, JSON as they write it, DSML call blocks, turn lookup.

The markup itself is documented in mlaserve/tool_calls/dsml.py (the parser's side of the same format).
"""

from __future__ import annotations

import json

from mlaserve.tool_calls.deepseek_tokens import DSML, END_OF_SENTENCE

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = END_OF_SENTENCE
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK_START = "<think>"
THINK_END = "</think>"


def to_json(value: object) -> str:
    """JSON with non-ASCII text kept as is; the encoders fall back to escapes only where that fails (a lone
    surrogate), so one odd character does not lose the whole schema."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True)


def dsml_parameter(name: str, value: object) -> str:
    """Strings go verbatim (string="true"); every other value as JSON (string="false")."""
    if isinstance(value, str):
        return f'<{DSML}parameter name="{name}" string="true">{value}</{DSML}parameter>'
    return f'<{DSML}parameter name="{name}" string="false">{to_json(value)}</{DSML}parameter>'


def dsml_calls(calls: list[dict], block_name: str) -> str:
    """An assistant turn's calls as one DSML block, after the blank line that separates it from the text."""
    invokes = []
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        params = "\n".join(dsml_parameter(k, v) for k, v in arguments.items())
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n{params}\n</{DSML}invoke>')
    body = "\n".join(invokes)
    return f"\n\n<{DSML}{block_name}>\n{body}\n</{DSML}{block_name}>"


def tool_schemas(tools: list[dict]) -> str:
    """One JSON line per function (the OpenAI wrapper {"type": "function", ...} dropped)."""
    return "\n".join(to_json(tool["function"]) for tool in tools)


def last_user_index(messages: list[dict]) -> int:
    """The last user or developer turn (-1 if none): reasoning after it belongs to the turn in progress."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1
