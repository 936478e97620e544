"""OpenAI's `tools` and `tool_choice` on /v1/chat/completions: validation, the chat template's view, and the
grammar that enforces `required` and a named function.

Tools are checked member by member so a 400 names the exact field (tools[1].function.parameters). `required`
and a named function are not left to the model: the output is constrained (llguidance, as response_format is) to
the call's JSON, so arguments always parse and fit the schema whatever the model writes on its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.server.errors import bad_request
from mlaserve.server.protocol import ChatCompletionRequest, ChatMessage
from mlaserve.server.tool_schema import closed

# OpenAI's rule for function names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """What a request asks of tool calls. kind: "none" (plain text), "auto" (the parser decides), "required"
    (one or more calls, enforced) or "named" (one call of `name`, enforced)."""

    kind: str
    tools: list[dict] = field(default_factory=list)
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.kind in ("required", "named")

    def grammar(self, parallel: bool) -> StructuredOutputsParams | None:
        """The constraint that enforces a forced mode (arguments hold only declared parameters unless the schema
        says otherwise: tool_schema.py); None for the others."""
        if self.kind == "named":
            return StructuredOutputsParams(json=closed(self.parameters(self.name)))
        if self.kind == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, parallel))
        return None

    def parameters(self, name: str | None) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """An array of calls, each {"name": ..., "arguments": ...} with the arguments of the tool it names. The
    properties come in this order, and llguidance writes them in schema order, so the name is always known before
    the arguments start (forced_calls.py streams on that)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": closed(tool["function"].get("parameters") or _EMPTY_PARAMETERS),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def validate_tools(raw: list | None) -> list[dict]:
    """The request's tools as plain dicts, or a 400 naming the first bad member."""
    if raw is None:
        return []
    tools: list[dict] = []
    names: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        extra = set(tool) - {"type", "function"}
        if extra:
            raise bad_request(f"{where} has unknown field(s): {', '.join(sorted(extra))}", where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object", f"{where}.function")
        _check_function(function, f"{where}.function", names)
        tools.append({"type": "function", "function": function})
    return tools


def _check_function(function: dict, where: str, names: set[str]) -> None:
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise bad_request(f"{where} has unknown field(s): {', '.join(sorted(extra))}", where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{where}.name"
        )
    if name in names:
        raise bad_request(f"{where}.name {name!r} is given twice", f"{where}.name")
    names.add(name)
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    parameters = function.get("parameters")
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    if parameters.get("type", "object") != "object":
        raise bad_request(
            f"{where}.parameters must describe an object (type 'object'), got type {parameters['type']!r}",
            f"{where}.parameters",
        )
    _check_schema(parameters, f"{where}.parameters")


def _check_schema(schema: dict, where: str) -> None:
    """A schema that is not valid JSON schema (a misspelt type, properties that are not an object) is the
    client's error now, not a model that sees a garbled tool list."""
    try:
        import jsonschema
    except ImportError:  # the grammar compile still catches what llguidance cannot use
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise bad_request(f"{where}{path} is not a valid JSON schema: {e.message}", where) from None


def tool_mode(req: ChatCompletionRequest, tools: list[dict], auto_parser: str | None) -> ToolMode:
    """The request's ToolMode; a 400 naming tool_choice for a choice the request or the server cannot serve."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's defaults
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if (
            choice.get("type") != "function"
            or not isinstance(name, str)
            or set(choice) != {"type", "function"}
        ):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolMode("named", tools, name)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto' or 'required', got {choice!r}", "tool_choice")
    if choice == "none":
        return ToolMode("none", tools)
    if not tools:
        raise bad_request(f"tool_choice {choice!r} needs a non-empty tools list", "tool_choice")
    if choice == "auto" and auto_parser is None:
        raise bad_request(
            "tool_choice 'auto' (the default when tools are given) needs a server started with "
            "--enable-auto-tool-choice and a --tool-call-parser; 'required' or a named function work without",
            "tool_choice",
        )
    return ToolMode(choice, tools)


def template_message(message: ChatMessage, index: int, arguments_as_text: bool = False) -> dict:
    """One message as Hugging Face chat templates read it: content always a string (templates concatenate it),
    call arguments as objects (Llama's and Qwen's templates write them with tojson), or as the client's JSON text
    for templates that join them into a string (DeepSeek's)."""
    out: dict = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages[{index}].tool_calls")
        out["tool_calls"] = [
            _template_call(c, index, j, arguments_as_text) for j, c in enumerate(message.tool_calls)
        ]
    if message.role == "tool":
        if message.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id", f"messages[{index}].tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def _template_call(call: object, index: int, j: int, as_text: bool) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        where = f"messages[{index}].tool_calls[{j}].function.arguments"
        raise bad_request(f"{where} is not valid JSON", where) from None
    function = {"name": call.function.name, "arguments": call.function.arguments if as_text else arguments}
    return {"id": call.id, "type": "function", "function": function}
