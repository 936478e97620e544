"""The server's tool-call and reasoning parsers, chosen once at start-up from its settings and its model."""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config.server_settings import ServerSettings
from mlaserve.tool_calls import (
    ReasoningParser,
    ToolParser,
    choose_tool_parser,
    get_reasoning_parser,
    get_tool_parser,
)


@dataclass(frozen=True)
class ServerParsers:
    """tool: the parser tool_choice "auto" uses (None: auto is refused); reasoning: splits <think> off replies."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None


def server_parsers(settings: ServerSettings, model_config: object, tokenizer: object | None) -> ServerParsers:
    """Raises ValueError naming the setting for an unknown parser, or for auto tool choice with no parser known."""
    name = settings.tool_call_parser
    if name is not None:
        get_tool_parser(name)  # an unknown name is a start-up error even without auto tool choice
    if settings.enable_auto_tool_choice and name is None:
        template = getattr(tokenizer, "chat_template", None)
        hf_config = getattr(model_config, "hf_config", None)
        for model in (getattr(hf_config, "model_type", None), getattr(model_config, "architecture", None)):
            name = choose_tool_parser(model, template if isinstance(template, str) else None)
            if name is not None:
                break
        if name is None:
            raise ValueError(
                "--enable-auto-tool-choice: no tool-call parser is known for this model's chat template or "
                "config; name one with --tool-call-parser"
            )
    tool = get_tool_parser(name) if settings.enable_auto_tool_choice and name is not None else None
    reasoning = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    return ServerParsers(tool, reasoning)
