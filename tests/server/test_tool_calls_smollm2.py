"""The OpenAI tools API with the real `openai` client against one live server on SmolLM2 (the default model):
forced calls (a named function, "required") parse and fit their schema whole and streamed, "auto" and a follow-up
turn with the tool's result are served, malformed tools are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from mlaserve.config.engine_config import EngineConfig
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.engine.llm_engine import LLMEngine
from tests.server.conftest import live_server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    options = dict(dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=128)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**options)))
    settings = dict(served_model_name="smollm2", tool_call_parser="hermes", enable_auto_tool_choice=True)
    for live, _ in live_server(engine, **settings):
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, dict], str | None, str]:
    """Calls gathered by index as an OpenAI client does, the finish reason, and the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model="smollm2", stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id is not None:
                    assert call["id"] is None, "id comes once per call"
                    call["id"] = piece.id
                if piece.function.name is not None:
                    assert call["name"] is None, "the name comes once per call"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
    return calls, finish, content


def test_named_function_gives_a_call_that_fits_its_schema(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content is None
    check_calls(out.choices[0].message.tool_calls, {"get_weather"})
    calls, finish, content = streamed(
        client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0
    )
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == out.choices[0].message.tool_calls[0].function.arguments


def test_required_gives_calls_that_fit_their_schemas(client):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    out = client.chat.completions.create(model="smollm2", **kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, set(SCHEMAS))
    calls, finish, _ = streamed(client, **kwargs)
    assert finish == "tool_calls"
    whole = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == whole
    one = client.chat.completions.create(model="smollm2", parallel_tool_calls=False, **kwargs)
    assert len(one.choices[0].message.tool_calls) == 1


def test_required_with_sampling_still_fits(client):
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, n=3, seed=7
    )
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":  # a sample may run out of tokens inside a long string
            check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_auto_is_served_and_streams_like_whole(client):
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    out = client.chat.completions.create(model="smollm2", **kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
    calls, _, content = streamed(client, **kwargs)
    assert content == (message.content or "")
    assert [c["name"] for c in calls.values()] == [c.function.name for c in message.tool_calls or []]


def test_follow_up_turn_with_the_tool_result_is_served(client):
    first = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}
        for call in first.choices[0].message.tool_calls
    ]
    out = client.chat.completions.create(
        model="smollm2", messages=[*ASK, assistant, *results], tools=TOOLS, max_tokens=30, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(
        model="smollm2",
        messages=[*ASK, assistant, *results],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=10,
        temperature=0,
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function"}], "tools[0].function"),
        (
            [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[1].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
                }
            ],
            "tools[0].function.parameters",
        ),
        ([TOOLS[0], TOOLS[0]], "tools[1].function.name"),
    ],
)
def test_malformed_tools_are_400s_naming_the_field(client, tools, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, tools=tools, max_tokens=2)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize(
    "tool_choice",
    [
        {"type": "function", "function": {"name": "nope"}},
        "sometimes",
        {"type": "function"},
    ],
)
def test_bad_tool_choice_is_a_400(client, tool_choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=2
        )
    assert e.value.body["param"] == "tool_choice"


def test_forced_call_with_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=2,
        )
    assert e.value.body["param"] == "tool_choice"
