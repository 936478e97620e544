"""Each format parsed from replies as its model's template renders them, and from published examples."""

from __future__ import annotations

import json

import pytest

from mlaserve.tool_calls import TOOL_PARSERS, get_tool_parser
from tests.tool_calls.cases import rendered


def _calls(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_rendered_replies_parse_back(fmt: str) -> None:
    parser = get_tool_parser(fmt)
    for reply, content, calls in rendered(fmt):
        result = parser.parse(reply)
        assert result.content == content, reply
        assert _calls(result) == [(n, a) for n, a in calls], reply
        assert all(c.id.startswith("call_") for c in result.tool_calls)
        assert len({c.id for c in result.tool_calls}) == len(calls)


def test_deepseek_v3_published_example() -> None:
    # The two-call reply in vLLM's deepseekv3 parser docstring, as DeepSeek-V3's template renders it.
    reply = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n"
        '{"location": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        'get_current_weather\n```json\n{"location": "Shanghai"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    result = get_tool_parser("deepseek_v3").parse(reply)
    assert result.content == ""
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("get_current_weather", '{"location": "Beijing"}'),
        ("get_current_weather", '{"location": "Shanghai"}'),
    ]


def test_deepseek_v31_keeps_the_models_argument_text() -> None:
    reply = (
        "好的<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city":"杭州","days":[1, 2]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    result = get_tool_parser("deepseek_v31").parse(reply)
    assert result.content == "好的"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("get_weather", '{"city":"杭州","days":[1, 2]}')
    ]


def test_deepseek_v32_published_example() -> None:
    # The example in vLLM's deepseekv32 parser docstring: two invokes, string parameters, Chinese values.
    reply = (
        "<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="date" string="true">2024-01-16</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">北京</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="date" string="true">2024-01-16</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜function_calls>"
    )
    result = get_tool_parser("deepseek_v32").parse(reply)
    assert result.content == ""
    assert _calls(result) == [
        ("get_weather", {"location": "杭州", "date": "2024-01-16"}),
        ("get_weather", {"location": "北京", "date": "2024-01-16"}),
    ]
    assert result.tool_calls[0].arguments == '{"location": "杭州", "date": "2024-01-16"}'
    # The V3.2 block is not V4's, and the reverse.
    assert get_tool_parser("deepseek_v4").parse(reply).tool_calls == []


def test_deepseek_v4_typed_parameters() -> None:
    reply = (
        "Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Beijing</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">7</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"hourly": true, "fields": ["t", "rh"]}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="code" string="true">x = "1"\nprint(x)</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    result = get_tool_parser("deepseek_v4").parse(reply)
    assert result.content == "Checking."
    assert _calls(result) == [
        (
            "get_weather",
            {
                "city": "Beijing",
                "days": 7,
                "opts": {"hourly": True, "fields": ["t", "rh"]},
                "code": 'x = "1"\nprint(x)',
            },
        )
    ]


def test_hermes_with_content_before_and_between_text() -> None:
    reply = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>\nDone.'
    )
    result = get_tool_parser("hermes").parse(reply)
    assert _calls(result) == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert result.content == "Sure.\nDone."


@pytest.mark.parametrize(
    "reply",
    [
        '{"name": "get_weather", "parameters": {"location": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "arguments": {"location": "Paris"}}',
        '\n  {"name": "get_weather", "parameters": {"location": "Paris"}}  \n',
    ],
)
def test_llama3_json_single_call(reply: str) -> None:
    result = get_tool_parser("llama3_json").parse(reply)
    assert result.content == ""
    assert _calls(result) == [("get_weather", {"location": "Paris"})]


def test_llama3_json_content_is_not_a_call() -> None:
    parser = get_tool_parser("llama3_json")
    for reply in ["Paris is sunny.", '{"answer": 42}', '{"name": "f", "parameters": {}} and more', "{", ""]:
        result = parser.parse(reply)
        assert (result.content, result.tool_calls) == (reply, []), reply


def test_openai_shapes() -> None:
    result = get_tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    call = result.tool_calls[0]
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    first, rest = (
        get_tool_parser("hermes")
        .stream()
        .feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
        .tool_calls
    )
    assert first.to_openai() == {
        "index": 0,
        "id": first.id,
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert rest.to_openai() == {"index": 0, "function": {"arguments": "{}"}}
