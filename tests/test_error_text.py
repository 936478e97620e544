"""error_text: what a client sees of an engine failure is one line, with no backtrace and no path of this machine."""

from __future__ import annotations

import pytest

from mlaserve.error_text import error_text, first_line, strip_paths

PANIC = (
    "structured output (choice): panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
    "<backtrace>\n   0: <unknown>\n   1: llguidance::earley::grammar at /root/.cargo/registry/src/grammar.rs:412:9\n"
)


def test_an_exception_is_its_type_and_first_line() -> None:
    assert error_text(ValueError(PANIC)) == (
        "ValueError: structured output (choice): panic: assertion failed: "
        "grammar.symbols.len() < u16::MAX as usize - 10"
    )
    assert error_text(RuntimeError()) == "RuntimeError"


def test_a_repr_is_cut_at_its_first_escaped_newline() -> None:
    assert error_text(repr(RuntimeError("boom\nTraceback (most recent call last):"))) == "RuntimeError('boom"


def test_blank_leading_lines_are_skipped() -> None:
    assert first_line("\n  \n  real reason  \nmore") == "real reason"
    assert first_line("") == ""


@pytest.mark.parametrize(
    "text,want",
    [
        ("cannot open /home/ops/models/m/model.safetensors", "cannot open model.safetensors"),
        ("No such file: '/usr/lib/python3.11/site-packages/x.so'", "No such file: 'x.so'"),
        ("raised at mlaserve/runner/model_runner.py:88 in step", "raised at  in step"),
        ("panicked at src/earley/grammar.rs:412:9:", "panicked at :"),
        ("see http://example.org/a/b for details", "see http://example.org/a/b for details"),
        ("a ratio 3/4 and a/b stay", "a ratio 3/4 and a/b stay"),
    ],
)
def test_paths_and_source_locations_are_stripped(text: str, want: str) -> None:
    assert strip_paths(text) == want


def test_no_trace_of_this_machine_survives() -> None:
    text = error_text(
        OSError("[Errno 2] at /work/main/mlaserve/engine/core.py:122: no /root/.cache/x\n  File ...")
    )
    for mark in ("/work", "/root", ".py:", "File"):
        assert mark not in text, text
