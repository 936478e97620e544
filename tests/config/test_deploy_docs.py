"""docs/deploy.md's key table is the deployment file's reference: it lists every key the loader knows, no other,
each with the loader's default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mlaserve.config.deploy import DeployConfig, parse_bytes

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]*) \|", re.MULTILINE)


def documented() -> dict[str, str]:
    """key -> its default cell, from the table of section 2."""
    return {key: cell.strip() for key, cell in ROW.findall((REPO / "docs" / "deploy.md").read_text())}


def loader_defaults() -> dict[str, object]:
    return {
        f"{section}.{key}": value
        for section, keys in DeployConfig().model_dump().items()
        for key, value in keys.items()
    }


def test_the_table_lists_exactly_the_loaders_keys() -> None:
    assert sorted(documented()) == sorted(loader_defaults())


# Defaults given as one literal; the others are described in words (served_model_name: the path's basename).
LITERAL = {key: m.group(1) for key, cell in documented().items() if (m := re.fullmatch(r"`([^`]*)`", cell))}


@pytest.mark.parametrize("key", sorted(LITERAL))
def test_a_literal_default_is_the_loaders(key: str) -> None:
    value = yaml.safe_load(LITERAL[key])
    if key in ("server.max_body_bytes", "server.grammar_max_choice_bytes", "server.grammar_max_bytes"):
        value = parse_bytes(value)
    assert value == loader_defaults()[key], (key, LITERAL[key])
