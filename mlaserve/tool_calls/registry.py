"""Tool parsers by vLLM's names (--tool-call-parser), and a guess of the right one from a model."""

from __future__ import annotations

from mlaserve.tool_calls.block import BlockFormat, BlockStream
from mlaserve.tool_calls.deepseek_tokens import DSML, TOOL_SEP
from mlaserve.tool_calls.deepseek_v3 import DEEPSEEK_V3
from mlaserve.tool_calls.deepseek_v31 import DEEPSEEK_V31
from mlaserve.tool_calls.dsml import DEEPSEEK_V4, DEEPSEEK_V32
from mlaserve.tool_calls.hermes import HERMES
from mlaserve.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonStream
from mlaserve.tool_calls.parser import StreamFactory, ToolParser
from mlaserve.tool_calls.types import IdFactory, make_tool_call_id


def _blocks(fmt: BlockFormat) -> StreamFactory:
    return lambda id_factory: BlockStream(fmt, id_factory)


TOOL_PARSERS: dict[str, StreamFactory] = {
    "deepseek_v3": _blocks(DEEPSEEK_V3),
    "deepseek_v31": _blocks(DEEPSEEK_V31),
    "deepseek_v32": _blocks(DEEPSEEK_V32),
    "deepseek_v4": _blocks(DEEPSEEK_V4),
    "hermes": _blocks(HERMES),
    "llama3_json": Llama3JsonStream,
}


def get_tool_parser(name: str, id_factory: IdFactory = make_tool_call_id) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return ToolParser(name, TOOL_PARSERS[name], id_factory)


# model_type (config.json) or architecture to parser, where that alone decides. DeepSeek-V3, R1 and V3.1 share
# model_type deepseek_v3 and DeepseekV3ForCausalLM but differ in format, so those need the chat template.
_BY_MODEL = {
    "deepseek_v32": "deepseek_v32",
    "deepseekv32forcausallm": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
    "deepseekv4forcausallm": "deepseek_v4",
}


def choose_tool_parser(model: str | None, chat_template: str | None = None) -> str | None:
    """The parser name for a model, from its chat template's call rendering when there is one, else from its
    model_type or architecture; None where neither says (the caller then asks for --tool-call-parser)."""
    template = chat_template or ""
    if f"<{DSML}tool_calls>" in template:
        return "deepseek_v4"
    if f"<{DSML}function_calls>" in template or DSML in template:
        return "deepseek_v32"
    if TOOL_SEP in template:
        # V3/R1 put the call type before the separator and the name after; V3.1 puts the name before it.
        if "+ tool['type'] + '" + TOOL_SEP in template or "tool['type'] + '" + TOOL_SEP in template:
            return "deepseek_v3"
        if "['name'] + '" + TOOL_SEP in template:
            return "deepseek_v31"
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return "llama3_json"
    return _BY_MODEL.get((model or "").lower())
