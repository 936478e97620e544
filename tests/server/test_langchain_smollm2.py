"""LangChain's ChatOpenAI against one live server on SmolLM2 with a tool parser, through chat completions and
through the Responses API: bound tools come back as tool calls (auto, named, "any"), structured output by
function calling gives a valid object (LangChain sends a named tool_choice, which the grammar enforces), streamed
calls gather to the same call, and a turn with the tool's result is served."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from mlaserve.config.engine_config import EngineConfig
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.engine.llm_engine import LLMEngine
from tests.server.conftest import live_server

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402 - only once langchain is known
from langchain_core.tools import tool  # noqa: E402

pytestmark = pytest.mark.slow
ASK = "What is the weather in Paris?"


class Weather(BaseModel):
    """The weather asked about."""

    city: str = Field(max_length=30, description="the city")
    unit: str = Field(description="celsius or fahrenheit")
    days: int = Field(ge=1, le=7, description="how many days ahead")


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@tool
def get_time(timezone: str) -> str:
    """The local time in a timezone."""
    return "noon"


@pytest.fixture(scope="module")
def url() -> str:
    options = dict(dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=128)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**options)))
    settings = dict(served_model_name="smollm2", tool_call_parser="hermes", enable_auto_tool_choice=True)
    for live, _ in live_server(engine, **settings):
        yield f"{live.url}/v1"
    engine.shutdown()


@pytest.fixture(params=[False, True], ids=["chat", "responses"])
def llm(url, request):
    return langchain_openai.ChatOpenAI(
        base_url=url,
        api_key="unused",
        model="smollm2",
        temperature=0,
        max_tokens=120,
        max_retries=0,
        use_responses_api=request.param,
    )


def test_bound_tools_are_called_when_asked(llm):
    auto = llm.bind_tools([get_weather, get_time]).invoke(ASK)
    assert auto.content or auto.tool_calls
    for choice, names in (("get_weather", {"get_weather"}), ("any", {"get_weather", "get_time"})):
        message = llm.bind_tools([get_weather, get_time], tool_choice=choice).invoke(ASK)
        assert message.tool_calls and not message.invalid_tool_calls
        for call in message.tool_calls:
            assert call["name"] in names and call["id"].startswith("call_") and isinstance(call["args"], dict)
    named = llm.bind_tools([get_weather], tool_choice="get_weather")
    whole = named.invoke(ASK)
    assert isinstance(whole.tool_calls[0]["args"]["city"], str)
    chunks = list(named.stream(ASK))
    gathered = chunks[0]
    for chunk in chunks[1:]:
        gathered = gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]


def test_structured_output_by_function_calling_is_a_valid_object(llm):
    answer = llm.with_structured_output(Weather, method="function_calling").invoke(
        "The weather in Paris in celsius for the next 3 days?"
    )
    assert isinstance(answer, Weather) and 1 <= answer.days <= 7 and len(answer.city) <= 30
    raw = llm.with_structured_output(Weather, method="function_calling", include_raw=True).invoke(ASK)
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Weather)


def test_a_turn_with_the_tool_result_is_served(llm):
    first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
    call = first.tool_calls[0]
    history = [
        HumanMessage(ASK),
        first,
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]),
    ]
    reply = llm.bind_tools([get_weather]).invoke(history)
    assert reply.content or reply.tool_calls
