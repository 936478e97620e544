"""The text of an engine failure as a client may see it: one line, no backtrace, no path of this machine.

Exceptions from native extensions carry whole backtraces in their message (llguidance's Rust panics do), and
Python's own name the files they were raised in. An error body is read by whoever sent the request, so it gets
the first line only, with file locations dropped and absolute paths cut to their last part; the full text
belongs to the server's log.
"""

from __future__ import annotations

import re

# "src/earley/grammar.rs:412:9", "model_runner.py:88": where in the source, which a client cannot use.
_SOURCE_LOCATION = re.compile(r"[\w./\\-]*\.(?:py|rs|c|cc|cpp|cu|h|hpp)(?::\d+)+")
# An absolute path ("/home/x/models/m/config.json"); not one inside a URL (the look-behind skips "//host/...").
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.])(?:/[\w.+@~-]+)+/([\w.+@~-]+)")
# repr() of an exception escapes its newlines: its first line ends at the first escaped one too.
_LINE_END = re.compile(r"\r?\n|\\n")


def first_line(text: str) -> str:
    """The first non-blank line of `text`."""
    for line in _LINE_END.split(text):
        if line.strip():
            return line.strip()
    return ""


def strip_paths(text: str) -> str:
    """File locations dropped and absolute paths cut to their last part (a file's name, not where it lives)."""
    text = _SOURCE_LOCATION.sub("", text)
    return _ABSOLUTE_PATH.sub(r"\1", text)


def error_text(error: BaseException | str) -> str:
    """One line for a client: an exception as `Type: first line of its message`, a string as its first line,
    either without paths of this machine."""
    if isinstance(error, BaseException):
        message = first_line(str(error))
        text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    else:
        text = first_line(error)
    return " ".join(strip_paths(text).split())
