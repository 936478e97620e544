"""Checks on argument text: OpenAI's arguments are the JSON text of an object."""

from __future__ import annotations

import json


def json_object_text(text: str) -> str | None:
    """text stripped if it is a JSON object, else None. The model's own spelling is kept (not re-dumped), so a
    client sees the arguments exactly as generated."""
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return text if isinstance(value, dict) else None


def dump_arguments(arguments: dict) -> str:
    # ensure_ascii=False: non-ASCII argument text reaches the client as the characters, as the templates render it.
    return json.dumps(arguments, ensure_ascii=False)
