"""A structured-output grammar that cannot be compiled: the client's error, told in one line.

llguidance reports a bad grammar in its own words: several lines with a caret drawing for a regex, a position in
the Lark grammar it generated from a schema, or a Rust panic with its whole backtrace when an internal limit is
hit. A client needs the field it set and the reason; the server puts its own field name in front.
"""

from __future__ import annotations

import re

from mlaserve.error_text import strip_paths

# Error texts quote what the client sent (a regex, a schema fragment): enough of it to recognise.
_MAX_REASON_CHARS = 400
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
}
_POSITION = re.compile(r"^at \d+\(\d+\): ")


class GrammarError(ValueError):
    """A request's output constraint that cannot be compiled. `kind` is the StructuredOutputsParams field that set
    it; `reason` is one line, for a client (the server names its own request field before it)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind}: {reason}")
        self.kind = kind
        self.reason = reason


def compile_error(kind: str, message: str) -> GrammarError:
    """llguidance's error text as one line: a panic's first line (its backtrace dropped), a regex error's own
    reason joined to its heading, no position in the grammar llguidance generated from a schema, regex or list."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = lines[0] if lines else "unknown error"
    if text.startswith("panic:"):
        detail = text.removeprefix("panic:").strip()
        text = f"it is too large or complex for llguidance ({detail})"
    elif text.endswith(":"):  # "regex parse error:" and a caret drawing; the reason is the "error:" line
        reason = next((line for line in lines[1:] if line.startswith("error:")), None)
        if reason is not None:
            text = f"{text} {reason.removeprefix('error:').strip()}"
    if kind != "grammar":
        text = _POSITION.sub("", text)
    text = " ".join(strip_paths(text).split())
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return GrammarError(kind, f"the {_WHAT.get(kind, 'grammar')} cannot be compiled: {text}")
