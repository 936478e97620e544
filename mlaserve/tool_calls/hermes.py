"""Hermes (also Qwen2.5/Qwen3's templates): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
consecutive calls separated by a newline, after the content."""

from __future__ import annotations

import json

from mlaserve.tool_calls.block import BlockFormat
from mlaserve.tool_calls.json_args import dump_arguments


def read_hermes_call(inner: str) -> tuple[str, str] | None:
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    return name_and_arguments(call)


def name_and_arguments(call: object) -> tuple[str, str] | None:
    """{"name": str, "arguments" or "parameters": object} to (name, arguments JSON); Llama's templates say
    "parameters" where Hermes says "arguments"."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models emit the arguments already as JSON text, as OpenAI's own field is.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], dump_arguments(arguments)


HERMES = BlockFormat("<tool_call>", None, "<tool_call>", "</tool_call>", read_hermes_call)
