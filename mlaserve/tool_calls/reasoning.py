"""Reasoning in model output: the text between <think> and </think> becomes reasoning_content, the rest content.

DeepSeek-R1's chat template ends the prompt with `<think>\\n`, so the reply usually starts inside the reasoning
with no opening tag; starts_in_reasoning says so. A reply whose prompt closed the thinking (`</think>` in the
prompt, as V3.1's non-thinking mode renders) passes starts_in_reasoning=False and is content unless it opens a
<think> itself. A reply that never closes its reasoning is all reasoning, as when generation stops mid-thought.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlaserve.tool_calls.stream import partial_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningDelta:
    """Both fields are "" where there is none, in a delta and in a whole reply alike."""

    reasoning: str = ""
    content: str = ""


def collect_reasoning(deltas: Iterable[ReasoningDelta]) -> ReasoningDelta:
    out = ReasoningDelta()
    for delta in deltas:
        out.reasoning += delta.reasoning
        out.content += delta.content
    return out


_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ThinkStream:
    """Feed text deltas, then finish once. Text that may be the start of a tag is held back until decided."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = _START
        self._buf = ""
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """True once the text is content, so the caller can hand what follows to a tool parser."""
        return self._state == _CONTENT

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise ValueError("feed() after finish(): a stream parses one reply")
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == _START:
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START) :]
                self._state = _REASONING
            elif THINK_START.startswith(self._buf) and not final:
                return out
            else:
                self._state = _REASONING if self._starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            end = self._buf.find(THINK_END)
            if end >= 0:
                out.reasoning = self._buf[:end]
                self._buf = self._buf[end + len(THINK_END) :]
                self._state = _CONTENT
            else:
                keep = 0 if final else partial_suffix_len(self._buf, THINK_END)
                out.reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out
        out.content, self._buf = self._buf, ""
        return out


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool = True

    def stream(self) -> ThinkStream:
        return ThinkStream(self.starts_in_reasoning)

    def parse(self, text: str) -> ReasoningDelta:
        """The whole reply as (reasoning, content); a stream fed it in one piece, so both ways agree."""
        stream = self.stream()
        return collect_reasoning([stream.feed(text), stream.finish()])


# deepseek_r1 as vLLM names it; the flag is per request where the template can turn thinking off.
REASONING_PARSERS = ("deepseek_r1",)


def get_reasoning_parser(name: str, starts_in_reasoning: bool = True) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(name, starts_in_reasoning)
