"""Tool calls in model output: parsing whole replies and streams into OpenAI's tool_calls, per model format."""

from mlaserve.tool_calls.parser import ToolParser
from mlaserve.tool_calls.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    ThinkStream,
    get_reasoning_parser,
)
from mlaserve.tool_calls.registry import TOOL_PARSERS, choose_tool_parser, get_tool_parser
from mlaserve.tool_calls.stream import ToolCallStream
from mlaserve.tool_calls.types import (
    ParseResult,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    collect,
    make_tool_call_id,
)

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ThinkStream",
    "get_reasoning_parser",
    "TOOL_PARSERS",
    "ParseResult",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "choose_tool_parser",
    "collect",
    "get_tool_parser",
    "make_tool_call_id",
]
