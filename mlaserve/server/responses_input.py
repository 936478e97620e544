"""A `/v1/responses` request as the chat request it means, so both endpoints share one template, tool and grammar
path; and chat's errors renamed to the Responses fields the client set.

Input items become chat messages: a function_call joins the assistant turn before it (Responses lists a turn's
text and its calls as separate items, chat keeps them in one message), a function_call_output is a tool message,
and a reasoning item is the next assistant message's reasoning_content.
"""

from __future__ import annotations

import json
import re

from mlaserve.server.body import validate
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.fields import check_unread_fields
from mlaserve.server.protocol import ChatCompletionRequest
from mlaserve.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    ReasoningInputItem,
    ResponsesRequest,
    TextPart,
)

# Fields that describe the caller or the transport; they cannot change what is generated.
INFORMATIONAL = frozenset(
    {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options"}
)
# Fields this server does not implement, with the values that mean "not used".
NOT_SUPPORTED: dict[str, tuple[object, ...]] = {
    "background": (False,),
    "conversation": (),
    "max_tool_calls": (),
    "prompt": (),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
}
# What `include` may ask for: the only one is encrypted reasoning, which a stateless server with plain reasoning
# text has no use for, so asking costs nothing.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    check_unread_fields(req, INFORMATIONAL, NOT_SUPPORTED)
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the whole "
            "conversation in input (earlier output items may be sent back as they came)",
            "previous_response_id",
        )
    for i, name in enumerate(req.include or []):
        if name not in _INCLUDABLE:
            raise bad_request(f"include[{i}] {name!r} is not supported by this server", "include")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += input_messages(req.input)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)  # templates that read it (gpt-oss's) obey
    body = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "response_format": req.text.format.chat_format() if req.text and req.text.format else None,
        "chat_template_kwargs": kwargs or None,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def input_messages(value: str | list) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    messages: list[dict] = []
    reasoning: str | None = None  # a reasoning item waits for the assistant message it belongs to
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise bad_request(f"{where} must be an object (an input item)", where)
        kind = raw.get("type", "message")
        if kind == "message":
            item = validate(InputMessage, raw, where)
            message = {"role": item.role, "content": _text(item.content, f"{where}.content")}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = validate(FunctionCallItem, raw, where)
            _check_arguments(call.arguments, f"{where}.arguments")
            function = {"name": call.name, "arguments": call.arguments}
            entry = {"id": call.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(entry)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            result = validate(FunctionCallOutputItem, raw, where)
            content = _text(result.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": result.call_id, "content": content})
        elif kind == "reasoning":
            thought = validate(ReasoningInputItem, raw, where)
            reasoning = "".join(part.text for part in (thought.content or thought.summary))
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not supported by this server; input items may be 'message', "
                "'function_call', 'function_call_output' or 'reasoning'",
                f"{where}.type",
            )
    return messages


def _text(content: str | list[dict], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(f"{where}[{j}] is {kind!r}: this server reads text only", f"{where}[{j}].type")
        texts.append(validate(TextPart, raw, f"{where}[{j}]").text)
    return "".join(texts)


def _check_arguments(arguments: str, where: str) -> None:
    try:
        json.loads(arguments)
    except ValueError:
        raise bad_request(f"{where} is not valid JSON", where) from None


def chat_tools(tools: list | None) -> list | None:
    """Responses' flat function tools in chat's nested shape; tools.py then checks them as it checks chat's."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise bad_request(
                f"{where}.type must be 'function' (this server runs no built-in tools), got {tool.get('type')!r}",
                f"{where}.type",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


_TOOL_FUNCTION = re.compile(r"(tools\[\d+\])\.function\b")
# chat's field names in messages and params, and what the Responses client called them
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_error(error: OpenAIError) -> OpenAIError:
    """A chat error as the Responses client would name its fields."""

    def rename(text: str) -> str:
        text = _TOOL_FUNCTION.sub(r"\1", text)
        for old, new in _RENAMED.items():
            text = text.replace(old, new)
        return text

    error.message = rename(error.message)
    error.args = (error.message,)
    if error.param is not None:
        error.param = "input" if error.param.startswith("messages") else rename(error.param)
    return error
