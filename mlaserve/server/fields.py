"""Request fields the server does not read: accepted only where they cannot change the output, else a 400.

OpenAI's API grows new fields often, and a client that sets one expects it to act. Dropping it in silence
turns a clear "not supported" into a confusing failure much later (LangChain's structured output with
`tools` used to fail on the output's length), so every top-level field the protocol models do not declare
goes through `check_unread_fields`. `null` means "the default" for every field, as in OpenAI's API.
"""

from __future__ import annotations

from pydantic import BaseModel

from mlaserve.server.errors import bad_request

# They describe the caller, or ask for bookkeeping that has no effect on what is generated.
INFORMATIONAL = frozenset(
    {"user", "metadata", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"}
)

# OpenAI fields this server does not implement, with the values that mean "not used". Chat declares tools and
# tool_choice itself, so those two entries only speak for /v1/completions.
NOT_SUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": (),
    "tool_choice": ("none",),
    "functions": (),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "suffix": ("",),
}


def check_unread_fields(
    request: BaseModel,
    informational: frozenset[str] = INFORMATIONAL,
    not_supported: dict[str, tuple[object, ...]] = NOT_SUPPORTED,
) -> None:
    """Raises a 400 naming the first field that would be ignored although it asks for something. The tables are
    chat's and completions'; /v1/responses passes its own."""
    for name, value in (request.model_extra or {}).items():
        if value is None or name in informational:
            continue
        if name in not_supported:
            if any(value == neutral and type(value) is type(neutral) for neutral in not_supported[name]):
                continue
            raise bad_request(f"'{name}' is not supported by this server (got {_short(value)})", name)
        raise bad_request(f"unknown field '{name}': this server does not read it", name)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
