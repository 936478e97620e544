"""OpenAI's Responses API with the real `openai` client against one live server on SmolLM2: plain text equals
chat's for the same conversation, streams build the whole response (also through the SDK's own stream helper),
forced tool choices give function_call items whose arguments fit their schema, a follow-up turn sends those
items back, and malformed requests are 400s naming the Responses field."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

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
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "Local time", "parameters": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = "What is the weather in Paris, in celsius?"


class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    options = dict(dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=128)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**options)))
    settings = dict(served_model_name="smollm2", tool_call_parser="hermes", enable_auto_tool_choice=True)
    for live, _ in live_server(engine, **settings):
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def events_of(client: openai.OpenAI, **kwargs: object) -> list:
    return list(client.responses.create(model="smollm2", stream=True, **kwargs))


def streamed_text(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def check_calls(output: list, names: set[str]) -> list:
    calls = [item for item in output if item.type == "function_call"]
    assert calls
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_plain_text_is_chats_text_whole_and_streamed(client):
    kwargs = dict(instructions="Answer in one sentence.", max_output_tokens=24, temperature=0)
    out = client.responses.create(model="smollm2", input="Name a color.", **kwargs)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "smollm2"
    assert out.status in ("completed", "incomplete")
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text and out.usage.output_tokens <= 24
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": kwargs["instructions"]},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens

    events = events_of(client, input="Name a color.", **kwargs)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert events[-1].type == f"response.{out.status}"
    assert streamed_text(events) == out.output_text == events[-1].response.output_text
    with client.responses.stream(
        model="smollm2", input="Name a color.", **{**kwargs, "max_output_tokens": 60}
    ) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text


def test_max_output_tokens_ends_incomplete(client):
    kwargs = dict(input="Count from one to one hundred.", max_output_tokens=5, temperature=0)
    out = client.responses.create(model="smollm2", **kwargs)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 5
    events = events_of(client, **kwargs)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == out.output_text


def test_named_tool_choice_gives_one_call_that_fits(client):
    kwargs = dict(
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        temperature=0,
    )
    out = client.responses.create(model="smollm2", **kwargs)
    (call,) = check_calls(out.output, {"get_weather"})
    assert out.status == "completed" and out.tool_choice.name == "get_weather"
    events = events_of(client, **kwargs)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == call.arguments == done[0].arguments
    assert [item.type for item in events[-1].response.output] == ["function_call"]


def test_required_gives_calls_that_fit_streamed_as_whole(client):
    kwargs = dict(input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=200, temperature=0)
    out = client.responses.create(model="smollm2", **kwargs)
    calls = check_calls(out.output, set(SCHEMAS))
    with client.responses.stream(model="smollm2", **kwargs) as s:
        final = s.get_final_response()
    assert [(c.name, c.arguments) for c in check_calls(final.output, set(SCHEMAS))] == [
        (c.name, c.arguments) for c in calls
    ]
    one = client.responses.create(model="smollm2", parallel_tool_calls=False, **kwargs)
    assert len(check_calls(one.output, set(SCHEMAS))) == 1 and one.parallel_tool_calls is False


def test_follow_up_turn_sends_the_output_items_back(client):
    first = client.responses.create(
        model="smollm2", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=200, temperature=0
    )
    results = [
        {"type": "function_call_output", "call_id": item.call_id, "output": json.dumps({"temperature": 21})}
        for item in first.output
        if item.type == "function_call"
    ]
    history = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}, *first.output, *results]
    out = client.responses.create(
        model="smollm2", input=history, tools=TOOLS, max_output_tokens=30, temperature=0
    )
    assert out.status in ("completed", "incomplete") and out.output
    none = client.responses.create(
        model="smollm2", input=history, tools=TOOLS, tool_choice="none", max_output_tokens=10, temperature=0
    )
    assert [item.type for item in none.output] == ["message"] and none.output_text


def test_text_format_json_schema_gives_json_that_fits_and_parse_reads_it(client):
    schema = {
        **WEATHER,
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": WEATHER["properties"]["unit"]},
    }
    out = client.responses.create(
        model="smollm2",
        input=ASK,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.output_text), schema)
    parsed = client.responses.parse(
        model="smollm2", input=ASK, text_format=Weather, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Weather) and parsed.output_parsed.unit in (
        "celsius",
        "fahrenheit",
    )


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(previous_response_id="resp_x"), "previous_response_id"),
        (dict(tools=[{"type": "function", "name": "has space"}]), "tools[0].name"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
        (dict(max_output_tokens=5000), "max_output_tokens"),
        (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
        (dict(model="other"), "model"),
    ],
)
def test_bad_requests_are_errors_naming_the_responses_field(client, kwargs, param):
    kwargs = {"model": "smollm2", "input": ASK, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(**kwargs)
    assert e.value.status_code in (400, 404) and e.value.body["param"] == param, e.value.body
