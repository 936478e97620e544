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


@pytest.mark.parametrize("key", sorted(loader_defaults()))
def test_a_literal_default_is_the_loaders(key: str) -> None:
    cell = documented()[key]
    literal = re.fullmatch(r"`([^`]*)`", cell)
    if literal is None:  # a default described in words (served_model_name: the path's basename)
        pytest.skip(f"{key}: {cell}")
    value = yaml.safe_load(literal.group(1))
    if key == "server.max_body_bytes":
        value = parse_bytes(value)
    assert value == loader_defaults()[key], (key, cell)
