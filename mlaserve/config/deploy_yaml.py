"""Reading a deploy file: safe YAML, duplicate keys rejected, problems reported as DeployConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mlaserve.config.deploy_errors import DeployConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load keeps the last of two equal keys silently; a duplicated key in a deploy file is a mistake."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_deploy_yaml(path: Path, sections: list[str]) -> dict[str, Any]:
    """The file's top-level mapping; empty file or empty sections mean defaults."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeployConfigError([("", f"deploy config {str(path)!r} does not exist")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DeployConfigError([("", f"cannot read deploy config {str(path)!r}: {e}")]) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise DeployConfigError(
            [("", f"not valid YAML{where}: {getattr(e, 'problem', None) or e}")], str(path)
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DeployConfigError([("", f"must be a mapping with sections {', '.join(sections)}")], str(path))
    # an empty section (`cache:` with nothing under it) means "all defaults", not "not a mapping"
    return {key: {} if value is None else value for key, value in raw.items()}
