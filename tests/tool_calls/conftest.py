from __future__ import annotations

import itertools

import pytest

from mlaserve.tool_calls import ToolParser, get_tool_parser


def counting_parser(name: str) -> ToolParser:
    """A parser whose ids count from call_0, so two runs over the same reply give equal ids."""
    counter = itertools.count()
    return get_tool_parser(name, id_factory=lambda: f"call_{next(counter)}")


@pytest.fixture
def make_parser():
    return counting_parser
