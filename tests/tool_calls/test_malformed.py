"""Replies whose calls do not parse, or stop early, come back as content; nothing raises and nothing is lost."""

from __future__ import annotations

import json

import pytest

from mlaserve.tool_calls import TOOL_PARSERS, get_tool_parser
from tests.tool_calls.cases import rendered

S = "<｜tool▁calls▁begin｜>"
C = "<｜tool▁call▁begin｜>"
E = "<｜tool▁call▁end｜>"
SE = "<｜tool▁calls▁end｜>"
SEP = "<｜tool▁sep｜>"
D = "｜DSML｜"

# Replies whose first call is malformed: the whole text is content, exactly as generated.
FIRST_CALL_BAD = {
    "deepseek_v3": [
        f'Hi{S}{C}function{SEP}f\n```json\n{{"a": }}\n```{E}{SE}',  # invalid JSON
        f'{S}{C}function{SEP}f\n{{"a": 1}}{E}{SE}',  # no fence
        f"{S}{C}custom{SEP}f\n```json\n{{}}\n```{E}{SE}",  # not a function call
        f"{S}{C}function{SEP}f\n```json\n[1, 2]\n```{E}{SE}",  # arguments not an object
        f"{S}{SE}",  # empty block
        f"{S}junk{C}function{SEP}f\n```json\n{{}}\n```{E}{SE}",
    ],
    "deepseek_v31": [
        f'{S}{C}f{SEP}{{"a" 1}}{E}{SE}',
        f"{S}{C}{SEP}{{}}{E}{SE}",  # no name
        f"{S}{C}f{{}}{E}{SE}",  # no separator
        f'text {S}{C}f{SEP}{{"a": 1}}',  # never closed
    ],
    "deepseek_v32": [
        f'Hi\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">not json'
        f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>",
        f"<{D}function_calls>\n<{D}invoke>\n</{D}invoke>\n</{D}function_calls>",  # no name
        f'<{D}function_calls>\n<{D}invoke name="f">\nstray text\n</{D}invoke>\n</{D}function_calls>',
        f'<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">x</{D}invoke>',
        f"\n\n<{D}function_calls>\n</{D}function_calls>",
    ],
    "deepseek_v4": [
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="maybe">x</{D}parameter>\n'
        f"</{D}invoke>\n</{D}tool_calls>",
        f'Hi <{D}tool_calls>\n<{D}invoke name="f">\n',
    ],
    "hermes": [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n',  # never closed
        "<tool_call></tool_call>",
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": 1}',  # truncated
        '{"name": "f", "parameters": [1]}',
        '{"name": "f", "parameters": {}}; oops',
        "<|python_tag|>",
    ],
}


@pytest.mark.parametrize("fmt,reply", [(f, r) for f, rs in FIRST_CALL_BAD.items() for r in rs])
def test_malformed_first_call_is_all_content(fmt: str, reply: str) -> None:
    result = get_tool_parser(fmt).parse(reply)
    assert (result.content, result.tool_calls) == (reply, [])


def test_bad_second_call_keeps_the_first() -> None:
    good = f'{C}f{SEP}{{"a": 1}}{E}'
    bad = f"{C}g{SEP}{{oops}}{E}{SE}"
    result = get_tool_parser("deepseek_v31").parse("Hi" + S + good + bad)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": 1}')]
    assert result.content == "Hi" + bad


def test_missing_block_end_after_whole_calls_keeps_them() -> None:
    # Generation stopped at EOS right after a complete call; the calls stand.
    result = get_tool_parser("deepseek_v31").parse(f"{S}{C}f{SEP}{{}}{E}\n")
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", "{}")]
    assert result.content == ""


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_every_truncation_is_safe(fmt: str) -> None:
    # A reply cut anywhere (max_tokens, a stop string) never raises, and the calls it keeps are whole ones.
    parser = get_tool_parser(fmt)
    for reply, _, calls in rendered(fmt):
        expected = [(n, a) for n, a in calls]
        for cut in range(len(reply) + 1):
            result = parser.parse(reply[:cut])
            got = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
            assert got == expected[: len(got)], (fmt, cut)
