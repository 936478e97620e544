"""Tool definitions written into the system message, for chat templates that never read `tools`.

The text follows the call format the template itself writes (the one the model was trained on): DeepSeek-V3/R1 and
V3.1 templates render earlier calls and their results but not the tool list, and DeepSeek's model cards ask for
the list in the system prompt, in a "## Tools" section that shows the call format. Other templates (SmolLM2's) get
the Hermes format most small instruction-tuned models have seen. Each format is the one its tool parser reads.
"""

from __future__ import annotations

import json

import jinja2
from jinja2 import meta

from mlaserve.tool_calls import choose_tool_parser
from mlaserve.tool_calls.deepseek_tokens import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)


def reads_tools(template: str) -> bool:
    """Whether the template uses its `tools` variable (a word in a comment or a token name does not count)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # apply_chat_template reports it; a template it cannot parse reads nothing
        return "tools" in template


def tools_system_prompt(tools: list[dict], template: str) -> str:
    fmt = choose_tool_parser(None, template)
    if fmt == "deepseek_v3":
        return _deepseek(tools, _V3_CALL, _V3_RULES)
    if fmt == "deepseek_v31":
        return _deepseek(tools, _V31_CALL, _V31_RULES)
    return _hermes(tools)


def _hermes(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


# V3/R1 write a call as its type, the separator, the name, then the arguments in a ```json fence; calls are joined
# by a newline. V3.1 writes the name, the separator and the bare arguments, with nothing between calls.
_V3_CALL = (
    f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}tool_call_name\n```json\ntool_call_arguments\n```"
    f"{TOOL_CALL_END}{{{{additional_tool_calls}}}}{TOOL_CALLS_END}"
)
_V3_RULES = (
    "- `tool_call_name` is exactly the name of one of the tools above\n"
    "- `tool_call_arguments` is one JSON object that fits that tool's Parameters schema\n"
    "- several calls follow one another, each on a new line"
)
_V31_CALL = (
    f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{TOOL_CALL_END}"
    f"{{{{additional_tool_calls}}}}{TOOL_CALLS_END}"
)
_V31_RULES = (
    "- `tool_call_name` is exactly the name of one of the tools above\n"
    "- `tool_call_arguments` is one JSON object that fits that tool's Parameters schema\n"
    "- several calls follow one another directly, with nothing between them"
)


def _deepseek(tools: list[dict], call: str, rules: str) -> str:
    sections = []
    for tool in tools:
        function = tool["function"]
        parameters = json.dumps(function.get("parameters") or {}, ensure_ascii=False)
        sections.append(
            f"### {function['name']}\nDescription: {function.get('description') or ''}\n\nParameters: {parameters}\n"
        )
    return (
        "## Tools\nYou have access to the following tools:\n\n"
        + "\n".join(sections)
        + f"\nTo use a tool, write exactly:\n{call}\n\nWhere:\n{rules}\n"
    )
