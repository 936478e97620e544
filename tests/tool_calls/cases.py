"""Replies shared by the format and streaming tests."""

from __future__ import annotations

from tests.tool_calls.render import RENDER

WEATHER = ("get_weather", {"location": "北京", "unit": "celsius"})
# Nested objects and arrays, numbers, booleans, null, quotes, braces, an HTML-ish tag and non-ASCII text.
SEARCH = (
    "search",
    {
        "query": 'a "quoted" {brace} <b>tag</b> ünïcödé 🙂',
        "filters": {"tags": ["x", "ü"], "range": [1, 2.5], "deep": {"ok": True, "none": None}},
        "limit": 3,
    },
)
NO_ARGS = ("list_files", {})

CALL_SETS = [
    ("", [WEATHER]),
    ("Let me check the weather and search.", [WEATHER, SEARCH]),
    ("我来调用三个工具：", [WEATHER, NO_ARGS, SEARCH]),
]


def rendered(fmt: str) -> list[tuple[str, str, list]]:
    """(reply, expected content, expected calls) for every call set the format can express."""
    out = []
    for content, calls in CALL_SETS:
        if fmt == "llama3_json" and content:
            continue
        out.append((RENDER[fmt](content, calls), content, calls))
    return out
