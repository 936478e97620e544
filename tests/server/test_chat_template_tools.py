"""Tools and tool turns through chat templates written in DeepSeek's styles (V3: the call's type, the separator, the
name and the arguments joined into a ```json fence; V3.1: name, separator, bare arguments) and in SmolLM2's and
Llama's: the tool list goes into the system message in the template's own call format, earlier calls render with
the client's argument text where the template joins strings and as an object where it writes tojson."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from mlaserve.server.chat_template import _JOINS_ARGUMENTS, _render_keeping_none, render
from mlaserve.server.protocol import ChatCompletionRequest
from mlaserve.server.tool_prompts import reads_tools
from mlaserve.testing.tiny_models import save_byte_tokenizer
from mlaserve.tool_calls import get_tool_parser
from mlaserve.tool_calls.deepseek_tokens import (
    END_OF_SENTENCE,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

_TOKENS = dict(CB=TOOL_CALL_BEGIN, CE=TOOL_CALL_END, TCB=TOOL_CALLS_BEGIN, TCE=TOOL_CALLS_END, SEP=TOOL_SEP)
_TURNS = """{%- for message in messages -%}
{%- if message['role'] == 'system' -%}{{ message['content'] }}
{%- elif message['role'] == 'user' -%}{{ '<U>' + message['content'] }}
{%- elif message['role'] == 'assistant' and 'tool_calls' in message -%}{{ '<A>' + message['content'] + 'TCB' }}
{%- for tool in message['tool_calls'] -%}{{ CALL }}{%- endfor -%}{{ 'TCE' + EOS }}
{%- elif message['role'] == 'assistant' -%}{{ '<A>' + message['content'] + EOS }}
{%- elif message['role'] == 'tool' -%}{{ '<OUT>' + message['content'] + '</OUT>' }}
{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<A>' }}{%- endif -%}"""
V3_CALL = "'CB' + tool['type'] + 'SEP' + tool['function']['name'] + '\\n```json\\n' + tool['function']['arguments'] + '\\n```CE'"
# DeepSeek-R1's shape: the calls are written only for a turn whose content is None.
R1_TURNS = _TURNS.replace("and 'tool_calls' in message", "and message['content'] is none").replace(
    "'<A>' + message['content'] + 'TCB'", "'<A>TCB'"
)
V31_CALL = "'CB' + tool['function']['name'] + 'SEP' + tool['function']['arguments'] + 'CE'"


def _deepseek_style(call: str, turns: str = _TURNS) -> str:
    template = turns.replace("CALL", call).replace("EOS", repr(END_OF_SENTENCE))
    for name in ("TCB", "TCE", "CB", "CE", "SEP"):  # longest names first: TCB holds CB
        template = template.replace(name, _TOKENS[name])
    return template


SMOLLM2_STYLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA_STYLE = (
    "{% if tools %}TOOLS {{ tools | tojson }}{{ '\\n' }}{% endif %}{% for message in messages %}{{ message['role'] }}: "
    "{% if message.tool_calls %}{% for c in message.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
)
ARGS = '{"city": "Paris",  "unit": "celsius"}'  # the client's own spacing, which DeepSeek's templates keep
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("template_tokenizer")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def rendered(tokenizer, template: str, messages: list[dict] = MESSAGES) -> str:
    tokenizer.chat_template = template
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    return render(tokenizer, req, add_generation_prompt=True)


@pytest.mark.parametrize(
    "call, parser, written",
    [
        (
            V3_CALL,
            "deepseek_v3",
            f"{TOOL_CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{ARGS}\n```{TOOL_CALL_END}",
        ),
        (V31_CALL, "deepseek_v31", f"{TOOL_CALL_BEGIN}get_weather{TOOL_SEP}{ARGS}{TOOL_CALL_END}"),
    ],
)
def test_deepseek_templates_get_the_tool_list_in_their_format_and_the_call_as_sent(
    tokenizer, call, parser, written
):
    prompt = rendered(tokenizer, _deepseek_style(call))
    system, _, turns = prompt.partition("<U>")
    assert (
        system.startswith("Be brief.\n\n## Tools\n")
        and "### get_weather\nDescription: The weather in a city" in system
    )
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in system
    # the format shown in the tool list is the format the template writes and the parser reads
    example = system[system.index(TOOL_CALLS_BEGIN) : system.index(TOOL_CALLS_END) + len(TOOL_CALLS_END)]
    shown = get_tool_parser(parser).parse(
        example.replace("tool_call_arguments", "{}").replace("{{additional_tool_calls}}", "")
    )
    assert [c.name for c in shown.tool_calls] == ["tool_call_name"]
    assert f"<A>{TOOL_CALLS_BEGIN}{written}{TOOL_CALLS_END}{END_OF_SENTENCE}" in turns
    assert turns.endswith("<OUT>sunny</OUT><A>")
    turn = turns[turns.index("<A>") + 3 : turns.index(END_OF_SENTENCE)]
    (parsed,) = get_tool_parser(parser).parse(turn).tool_calls
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", json.loads(ARGS))


def test_a_template_that_joins_content_gets_a_string_and_the_hermes_list(tokenizer):
    prompt = rendered(tokenizer, SMOLLM2_STYLE)
    assert "<|im_start|>assistant\n<|im_end|>" in prompt and "None" not in prompt
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt


def test_a_template_that_writes_arguments_with_tojson_gets_an_object(tokenizer):
    prompt = rendered(tokenizer, LLAMA_STYLE)
    assert prompt.startswith("TOOLS ") and "## Tools" not in prompt and "<tools>" not in prompt
    line = next(line for line in prompt.splitlines() if line.startswith("assistant: "))
    assert json.loads(line.removeprefix("assistant: ")) == json.loads(ARGS)


def test_reads_tools_looks_at_the_variable_not_the_word():
    assert reads_tools("{% if tools %}{{ tools | length }}{% endif %}")
    assert not reads_tools("{{ 'tools are listed below' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not reads_tools(_deepseek_style(V3_CALL))


@pytest.mark.parametrize(
    "snippet, joins",
    [
        ("'```json' + '\\n' + tool['function']['arguments'] + '\\n```'", True),  # DeepSeek-V3
        ("tool['function']['name'] + '<sep>' + tool['function']['arguments']", True),  # DeepSeek-V3.1
        ("'args: ' ~ tool_call.arguments", True),
        ("{{- tool_call.arguments | tojson }}", False),  # Qwen, Llama
        ("', \"arguments\": ' + tool_call.function.arguments|tojson", False),  # Mistral's
        ("{{- '\"arguments\": ' + x | tojson }}", False),  # the key's name, not the value
        ("{% if tool_call.arguments is string %}{{ tool_call.arguments }}{% endif %}", False),
    ],
)
def test_arguments_go_as_text_only_to_templates_that_join_them(snippet, joins):
    assert bool(_JOINS_ARGUMENTS.search(snippet)) == joins


def test_a_template_that_writes_calls_only_for_none_content_gets_none(tokenizer):
    template = _deepseek_style(V3_CALL, R1_TURNS)
    assert "message['content'] is none" in template
    prompt = rendered(tokenizer, template)
    assert f"<A>{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{ARGS}" in prompt
    assert prompt.startswith("Be brief.\n\n## Tools") and prompt.endswith("<OUT>sunny</OUT><A>")


def test_rendering_that_keeps_none_is_apply_chat_template_otherwise(tokenizer):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for template in (SMOLLM2_STYLE, LLAMA_STYLE, _deepseek_style(V3_CALL)):
        tokenizer.chat_template = template
        want = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, tools=TOOLS)
        assert _render_keeping_none(tokenizer, plain, True, {"tools": TOOLS}) == want
