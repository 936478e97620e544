from __future__ import annotations

import random

import pytest

from mlaserve.tool_calls import ReasoningDelta, get_reasoning_parser
from mlaserve.tool_calls.reasoning import collect_reasoning

CASES = [
    # (reply, starts_in_reasoning, reasoning, content)
    (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        True,
        "\nLet me think.\n",
        "\n\nThe answer is 4.",
    ),
    ("Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.\n", "\n\nThe answer is 4."),
    ("Still thinking when the tokens ran out", True, "Still thinking when the tokens ran out", ""),
    ("思考中……</think>答案：四。", True, "思考中……", "答案：四。"),
    ("r</think>a</think>b", True, "r", "a</think>b"),
    ("</think>", True, "", ""),
    ("<thi", True, "<thi", ""),
    ("", True, "", ""),
    ("The answer is 4.", False, "", "The answer is 4."),
    ("<think>r</think>a", False, "r", "a"),
    ("<thi", False, "", "<thi"),
    ("x</think>y", False, "", "x</think>y"),
]


@pytest.mark.parametrize("reply,starts,reasoning,content", CASES)
def test_whole(reply: str, starts: bool, reasoning: str, content: str) -> None:
    assert get_reasoning_parser("deepseek_r1", starts).parse(reply) == ReasoningDelta(reasoning, content)


@pytest.mark.parametrize("reply,starts,reasoning,content", CASES)
def test_every_split(reply: str, starts: bool, reasoning: str, content: str) -> None:
    parser = get_reasoning_parser("deepseek_r1", starts)
    rng = random.Random(reply)
    splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)] + [list(reply)]
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(reply) + 1), k=min(len(reply) + 1, 4)))
        bounds = [0, *cuts, len(reply)]
        splits.append([reply[a:b] for a, b in zip(bounds, bounds[1:])])
    for pieces in splits:
        stream = parser.stream()
        got = collect_reasoning([stream.feed(p) for p in pieces] + [stream.finish()])
        assert got == ReasoningDelta(reasoning, content), pieces


def test_reasoning_streams_and_reports_its_end() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<think>Hmm").reasoning == "Hmm"
    assert stream.feed(", ok</thi") == ReasoningDelta(", ok", "")
    assert not stream.reasoning_ended
    assert stream.feed("nk>Yes") == ReasoningDelta("", "Yes")
    assert stream.reasoning_ended


def test_unknown_reasoning_parser() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("qwen3")
