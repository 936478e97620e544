"""Chat replies read through the parsers, on fake model output: forced-call text and <think> reasoning give the
same calls, content and reasoning whole and streamed at every split; chat.py's whole and streamed shapes."""

from __future__ import annotations

import json

import pytest

from mlaserve.server.chat import _message, _parsed_events
from mlaserve.server.chat_output import ChatDelta, OutputParsing, prompt_opens_reasoning
from mlaserve.server.generation import ChoiceUpdate
from mlaserve.server.tools import ToolMode, required_schema
from mlaserve.tool_calls import get_reasoning_parser, get_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]
REQUIRED = '[{"name": "f", "arguments": {"a": "}]\\"{", "b": [1, {"c": 2}]}}, {"name": "g", "arguments": {}}]'


def feed_split(parsing: OutputParsing, text: str, cut: int) -> dict:
    """The parts a client gathers from the text streamed in two deltas cut at `cut`."""
    parser = parsing.choice()
    deltas = [parser.feed(text[:cut], final=False), parser.feed(text[cut:], final=True)]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, {"name": None, "arguments": ""})
            call["name"] = piece.name or call["name"]
            call["arguments"] += piece.arguments
    return {
        "reasoning": "".join(d.reasoning for d in deltas),
        "content": "".join(d.content for d in deltas),
        "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
    }


def test_required_text_gives_each_call_at_every_split():
    parsing = OutputParsing(ToolMode("required", TOOLS))
    want = [("f", json.dumps(json.loads(REQUIRED)[0]["arguments"])), ("g", "{}")]
    for cut in range(len(REQUIRED) + 1):
        got = feed_split(parsing, REQUIRED, cut)
        assert got == {"reasoning": "", "content": "", "calls": want}, cut


def test_named_text_is_the_arguments():
    parsing = OutputParsing(ToolMode("named", TOOLS, "f"))
    text = '{"a": 1}'
    for cut in range(len(text) + 1):
        assert feed_split(parsing, text, cut)["calls"] == [("f", text)]


def test_required_schema_lists_each_tool_and_caps_parallel_calls():
    schema = required_schema(TOOLS, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["f", "g"]
    assert list(schema["items"]["anyOf"][0]["properties"]) == [
        "name",
        "arguments",
    ]  # name first, for streaming


def test_forced_call_grammars_close_objects_the_schema_leaves_open():
    nested = {
        "type": "object",
        "properties": {
            "where": {"$ref": "#/$defs/Place"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
            "free": {"type": "object"},
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        },
        "$defs": {"Place": {"properties": {"city": {"type": "string"}}}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested}}]
    original = json.dumps(nested, sort_keys=True)
    for schema in (
        ToolMode("named", tools, "f").grammar(True).json,
        ToolMode("required", tools).grammar(True).json["items"]["anyOf"][0]["properties"]["arguments"],
    ):
        assert schema["additionalProperties"] is False
        assert schema["$defs"]["Place"]["additionalProperties"] is False
        assert schema["properties"]["tags"]["items"]["additionalProperties"] is False
        assert schema["properties"]["extra"]["additionalProperties"] == {
            "type": "string"
        }  # said by the schema
        assert "additionalProperties" not in schema["properties"]["free"]  # a free-form map stays one
        assert all("additionalProperties" not in part for part in schema["properties"]["both"]["allOf"])
    assert json.dumps(nested, sort_keys=True) == original  # the client's tools are echoed unchanged


@pytest.mark.parametrize("starts_in_reasoning", [True, False])
def test_reasoning_split_whole_and_streamed(starts_in_reasoning):
    reasoning = get_reasoning_parser("deepseek_r1")
    parsing = OutputParsing(ToolMode("none"), None, reasoning, starts_in_reasoning)
    body = "Let me think.</think>The answer is 4."
    text = body if starts_in_reasoning else "<think>" + body
    want = {"reasoning": "Let me think.", "content": "The answer is 4.", "calls": []}
    for cut in range(len(text) + 1):
        assert feed_split(parsing, text, cut) == want, cut
    message, finish = _message(parsing, text, "stop")
    assert (message.reasoning_content, message.content, finish) == (
        "Let me think.",
        "The answer is 4.",
        "stop",
    )
    assert "tool_calls" not in message.model_dump()


def test_reasoning_then_a_hermes_call_streams_in_openai_shape():
    parsing = OutputParsing(
        ToolMode("auto", TOOLS), get_tool_parser("hermes"), get_reasoning_parser("deepseek_r1"), True
    )
    text = 'hmm</think>ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    message, finish = _message(parsing, text, "stop")
    assert finish == "tool_calls" and message.reasoning_content == "hmm"
    assert [c["function"]["name"] for c in message.tool_calls] == ["f"]
    assert json.loads(message.tool_calls[0]["function"]["arguments"]) == {"a": 1}

    parser = parsing.choice()
    events: list[dict] = []
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        update = ChoiceUpdate(0, piece, [1], None, "stop" if final else None)
        events += [json.loads(e[len("data: ") :]) for e in _parsed_events(parser, update, _chunk, [], 0)]
    deltas = [e["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm"
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "f" and calls[0]["type"] == "function" and calls[0]["id"]
    assert all("name" not in c["function"] and "id" not in c for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 1}
    assert events[-1]["finish_reason"] == "tool_calls"


def _chunk(choice: object) -> str:
    return "data: " + json.dumps(choice.model_dump()) + "\n\n"


def test_kept_end_token_is_not_content():
    parsing = OutputParsing(ToolMode("auto", TOOLS), get_tool_parser("deepseek_v3"), end_text="<END>")
    parser = parsing.choice()
    assert parser.feed("hello<END>", final=True) == ChatDelta(content="hello")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<think>a</think> answer <｜Assistant｜>")
    assert not prompt_opens_reasoning(None)
