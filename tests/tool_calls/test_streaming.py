"""A stream fed a reply in any split gives what the whole-reply parse gives, in OpenAI's delta shape."""

from __future__ import annotations

import random

import pytest

from mlaserve.tool_calls import TOOL_PARSERS, StreamDelta, collect
from tests.tool_calls.cases import rendered
from tests.tool_calls.conftest import counting_parser
from tests.tool_calls.test_malformed import FIRST_CALL_BAD

# Every format's replies, good and malformed, plus text that only looks like markup; each parser reads all of them,
# so each also sees other formats' markup as plain content.
NOISE = [
    "",
    "Plain answer with no calls.",
    "a < b and c <tool no, <｜tool and <｜DSML｜ are not calls",
    "ends with a partial marker <｜tool▁calls",
    "ends with whitespace \n\n",
    "{ starts like JSON but is prose",
    "  \n",
]
CORPUS = sorted(
    {reply for fmt in TOOL_PARSERS for reply, _, _ in rendered(fmt)}
    | {reply for replies in FIRST_CALL_BAD.values() for reply in replies}
    | set(NOISE)
)


def _stream(fmt: str, pieces: list[str]) -> list[StreamDelta]:
    stream = counting_parser(fmt).stream()
    return [stream.feed(p) for p in pieces] + [stream.finish()]


def _random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_every_split_matches_whole_parse(fmt: str) -> None:
    rng = random.Random(fmt)
    for reply in CORPUS:
        whole = counting_parser(fmt).parse(reply)
        splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)]
        splits.append(list(reply))  # one character at a time
        splits += [_random_splits(reply, rng) for _ in range(10)]
        for pieces in splits:
            assert collect(_stream(fmt, pieces)) == whole, (fmt, reply, pieces)


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_delta_shape(fmt: str) -> None:
    # id, type and name on a call's first delta only; indexes count up from 0 in order.
    for reply, _, calls in rendered(fmt):
        deltas = [d for delta in _stream(fmt, list(reply)) for d in delta.tool_calls]
        seen: set[int] = set()
        for d in deltas:
            first = d.index not in seen
            assert (d.id is not None, d.type is not None, d.name is not None) == (first, first, first)
            if first:
                assert d.index == len(seen) and d.type == "function"
                seen.add(d.index)
        assert len(seen) == len(calls)


def test_content_streams_before_the_reply_ends() -> None:
    stream = counting_parser("deepseek_v3").stream()
    assert stream.feed("Hello wor").content == "Hello wor"
    # A possible start of the block is held back, and the whitespace before it.
    assert stream.feed("ld \n<｜tool▁ca").content == "ld"
    assert stream.feed("lls▁begin｜>").content == ""
    assert stream.finish().content == " \n<｜tool▁calls▁begin｜>"


def test_a_whole_call_in_one_delta() -> None:
    stream = counting_parser("deepseek_v31").stream()
    delta = stream.feed(
        'Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
    )
    assert delta.content == "Hi"
    assert [(d.name, d.arguments) for d in delta.tool_calls] == [("f", ""), (None, '{"a": 1}')]
    assert not stream.feed("<｜tool▁calls▁end｜>") and not stream.finish()


def test_feed_after_finish_is_an_error() -> None:
    stream = counting_parser("hermes").stream()
    stream.finish()
    assert not stream.finish()
    with pytest.raises(ValueError):
        stream.feed("x")
