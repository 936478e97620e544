"""Assistant turns rendered the way each model's published chat template or encoder writes them, so the parsers
are tested on the text the models were trained to produce (not on text written to suit the parser)."""

from __future__ import annotations

import json

from mlaserve.tool_calls.deepseek_tokens import (
    DSML,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

Call = tuple[str, dict]


def deepseek_v3(content: str, calls: list[Call]) -> str:
    # DeepSeek-V3/R1 tokenizer_config.json: type, separator, name, newline, ```json fence; calls joined by "\n".
    rendered = [
        f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```"
        f"{TOOL_CALL_END}"
        for name, args in calls
    ]
    return content + TOOL_CALLS_BEGIN + "\n".join(rendered) + TOOL_CALLS_END


def deepseek_v31(content: str, calls: list[Call]) -> str:
    # DeepSeek-V3.1 tokenizer_config.json: name, separator, arguments; no separator between calls.
    rendered = [
        f"{TOOL_CALL_BEGIN}{name}{TOOL_SEP}{json.dumps(args, ensure_ascii=False)}{TOOL_CALL_END}"
        for name, args in calls
    ]
    return content + TOOL_CALLS_BEGIN + "".join(rendered) + TOOL_CALLS_END


def _dsml(block: str, content: str, calls: list[Call]) -> str:
    # DeepSeek-V3.2 encoding/encoding_dsv32.py and DeepSeek-V4's encoder: a blank line after the content, one
    # parameter per argument, strings verbatim with string="true", other values as JSON with string="false".
    invokes = []
    for name, args in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    return content + "\n\n" + f"<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def deepseek_v32(content: str, calls: list[Call]) -> str:
    return _dsml("function_calls", content, calls)


def deepseek_v4(content: str, calls: list[Call]) -> str:
    return _dsml("tool_calls", content, calls)


def hermes(content: str, calls: list[Call]) -> str:
    # Hermes / Qwen2.5 templates: content, then each call on its own lines inside <tool_call> tags.
    out = content
    for name, args in calls:
        if out:
            out += "\n"
        out += (
            "<tool_call>\n"
            + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            + "\n</tool_call>"
        )
    return out


def llama3_json(content: str, calls: list[Call]) -> str:
    # Llama 3.1's template: the reply is the call, {"name": ..., "parameters": ...}; several joined by "; ".
    assert not content, "the Llama JSON format has no content beside calls"
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


RENDER = {
    "deepseek_v3": deepseek_v3,
    "deepseek_v31": deepseek_v31,
    "deepseek_v32": deepseek_v32,
    "deepseek_v4": deepseek_v4,
    "hermes": hermes,
    "llama3_json": llama3_json,
}
