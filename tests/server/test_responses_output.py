"""/v1/responses without a model: fake replies read through the chat parsers become the same output items whole
and streamed at every split, every event fits the `openai` package's own event types, and input items become the
chat messages they mean."""

from __future__ import annotations

import itertools
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mlaserve.server.chat_output import OutputParsing
from mlaserve.server.errors import OpenAIError
from mlaserve.server.responses_input import chat_request, input_messages, responses_error
from mlaserve.server.responses_output import OutputItems
from mlaserve.server.responses_protocol import (
    IncompleteDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from mlaserve.server.tools import ToolMode
from mlaserve.tool_calls import get_reasoning_parser, get_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
REPLY = (
    "<think>Plan: call f.</think>Let me check.\n"
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
)
EVENTS = TypeAdapter(ResponseStreamEvent)


def parsing() -> OutputParsing:
    return OutputParsing(
        ToolMode("auto", TOOLS), get_tool_parser("hermes"), get_reasoning_parser("deepseek_r1"), False
    )


def streamed(text: str, cuts: list[int], incomplete: bool = False) -> tuple[list[dict], list]:
    """Events (numbered, as the stream writes them) and the items of `text` fed in pieces cut at `cuts`."""
    parser, items = parsing().choice(), OutputItems()
    events = []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        events += items.feed(parser.feed(text[a:b], final=i == len(bounds) - 2))
    events += items.finish(incomplete)
    return [{**e, "sequence_number": n} for n, e in enumerate(events)], items.items


def assembled(events: list[dict]) -> list[dict]:
    """What a streaming client builds from the events alone: each item as added, grown by its deltas."""
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = e["item"]
        elif e["type"] == "response.content_part.added":
            items[e["output_index"]]["content"].append(e["part"])
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            assert {**items[e["output_index"]], "status": e["item"]["status"]} == e["item"]
            items[e["output_index"]] = e["item"]
    return [items[i] for i in sorted(items)]


def test_reasoning_text_and_calls_become_items_in_order():
    _, items = streamed(REPLY, [])
    dumped = [item.model_dump() for item in items]
    assert [d["type"] for d in dumped] == ["reasoning", "message", "function_call", "function_call"]
    assert dumped[0]["content"] == [{"type": "reasoning_text", "text": "Plan: call f."}]
    assert dumped[1]["content"][0]["text"].strip() == "Let me check."
    assert [(d["name"], json.loads(d["arguments"])) for d in dumped[2:]] == [("f", {"a": 1}), ("g", {})]
    assert dumped[2]["call_id"].startswith("call_") and dumped[2]["id"].startswith("fc_")
    assert all(d["status"] == "completed" for d in dumped)


@pytest.mark.parametrize("cut", range(0, len(REPLY), 7))
def test_streamed_items_are_the_whole_items_at_every_split(cut):
    def shape(items: list) -> list:
        out = []
        for item in items:
            item = dict(item)
            item.pop("id"), item.pop("call_id", None)  # fresh per run
            out.append(item)
        return out

    _, whole = streamed(REPLY, [])
    events, items = streamed(REPLY, [cut, cut + 3])
    assert (
        shape(assembled(events))
        == shape([i.model_dump() for i in items])
        == shape([i.model_dump() for i in whole])
    )
    for event in events:
        EVENTS.validate_python(event)  # the openai package's own event types accept each one


def test_blank_text_between_calls_makes_no_message_and_an_empty_reply_one_empty_message():
    _, items = streamed('<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n\n', [])
    assert [i.type for i in items] == ["function_call"]
    _, items = streamed("", [])
    assert [(i.type, i.content[0].text) for i in items] == [("message", "")]


def test_cut_output_leaves_its_open_item_incomplete_and_the_response_fits_the_sdk():
    events, items = streamed("<think>still thinking", [5], incomplete=True)
    assert [(i.type, i.status) for i in items] == [("reasoning", "incomplete")]
    usage = ResponseUsage(input_tokens=3, output_tokens=4, total_tokens=7)
    response = ResponseObject(
        id="resp_1", created_at=1, status="incomplete", model="m", output=items, usage=usage
    )
    response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    parsed = Response.model_validate(response.model_dump())
    assert parsed.status == "incomplete" and parsed.output[0].type == "reasoning"


def test_input_items_become_chat_messages():
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "call_a",
            "name": "f",
            "arguments": '{"a": 1}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": "noon"},
    ]
    messages = input_messages(items)
    assert messages[0] == {"role": "user", "content": "Weather ?"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == "Checking."
    assert messages[1]["reasoning_content"] == "hm"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_a", "call_b"]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    ]


def test_request_fields_map_to_chat_fields():
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "hi",
            "instructions": "Be brief.",
            "max_output_tokens": 5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
            "store": False,
            "metadata": {"k": "v"},
        }
    )
    chat = chat_request(req)
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.max_completion_tokens == 5
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_bad_requests_name_the_responses_field(body, param):
    with pytest.raises(OpenAIError) as e:
        chat_request(ResponsesRequest.model_validate(body))
    assert e.value.status_code == 400 and e.value.param == param, e.value.message


def test_chat_errors_are_renamed_to_responses_fields():
    error = responses_error(OpenAIError(400, "tools[1].function.name must be ...", "tools[1].function.name"))
    assert (error.param, error.message) == ("tools[1].name", "tools[1].name must be ...")
    error = responses_error(OpenAIError(400, "max_completion_tokens=9 is more ...", "max_completion_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens=9 is more ...")
    assert responses_error(OpenAIError(400, "template failed", "messages")).param == "input"
