"""A chat choice's text split into reasoning, content and tool calls, streamed or whole.

Reasoning is split off first (a call written while thinking is not a call), then the rest goes through the tool
parser. Whole replies are the same parsers fed the whole text, so a streamed reply and a whole one agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaserve.server.forced_calls import NamedCallStream, RequiredCallsStream
from mlaserve.server.tools import ToolMode
from mlaserve.tool_calls import ReasoningParser, ThinkStream, ToolCallDelta, ToolCallStream, ToolParser
from mlaserve.tool_calls.reasoning import THINK_END, THINK_START
from mlaserve.tool_calls.types import make_tool_call_id


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """One choice's parsers; feed its text deltas in order, the last one with final=True."""

    def __init__(self, think: ThinkStream | None, calls: ToolCallStream | None, end_text: str | None) -> None:
        self._think = think
        self._calls = calls
        self._end_text = end_text
        self.made_calls = False

    def feed(self, text: str, final: bool) -> ChatDelta:
        if final and self._end_text and text.endswith(self._end_text):
            # kept special tokens (the parser needs its markers) include the end-of-turn token: not content
            text = text[: -len(self._end_text)]
        out = ChatDelta()
        content = text
        if self._think is not None:
            parts = [self._think.feed(text)] + ([self._think.finish()] if final else [])
            out.reasoning = "".join(p.reasoning for p in parts)
            content = "".join(p.content for p in parts)
        if self._calls is None:
            out.content = content
            return out
        parts = [self._calls.feed(content)] + ([self._calls.finish()] if final else [])
        out.content = "".join(p.content for p in parts)
        out.tool_calls = [c for p in parts for c in p.tool_calls]
        self.made_calls = self.made_calls or bool(out.tool_calls)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI ends a reply that called tools with "tool_calls" rather than "stop"."""
        return "tool_calls" if reason == "stop" and self.made_calls else reason


@dataclass(frozen=True)
class OutputParsing:
    """How a request's choices are read: a tool mode, the server's tool parser for "auto", its reasoning parser."""

    mode: ToolMode
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    starts_in_reasoning: bool = False
    end_text: str | None = None

    @property
    def active(self) -> bool:
        return self.mode.forced or self.reasoning is not None or self._auto

    @property
    def _auto(self) -> bool:
        return self.mode.kind == "auto" and self.tool_parser is not None

    def choice(self) -> ChoiceParser:
        calls: ToolCallStream | None = None
        if self.mode.kind == "named":
            calls = NamedCallStream(self.mode.name or "", make_tool_call_id)
        elif self.mode.kind == "required":
            calls = RequiredCallsStream(make_tool_call_id)
        elif self._auto:
            calls = self.tool_parser.stream()
        # A forced call is constrained from its first token: there is no reasoning to split off.
        think = None if self.reasoning is None or self.mode.forced else ThinkStream(self.starts_in_reasoning)
        return ChoiceParser(think, calls, self.end_text)


def prompt_opens_reasoning(prompt: str | None) -> bool:
    """Whether the prompt ends inside an open <think> (R1's template writes one), so the reply starts as
    reasoning; an earlier turn's closed <think>...</think> does not count."""
    if not prompt:
        return False
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


# Parsers whose markers are special tokens, which detokenizing drops unless asked to keep them.
_NEEDS_SPECIAL_TOKENS = frozenset(
    {"deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "llama3_json"}
)


def needs_special_tokens(parser: ToolParser | None) -> bool:
    return parser is not None and parser.name in _NEEDS_SPECIAL_TOKENS
