"""Deploy-config errors an operator can act on: every problem names its key path and what is allowed.

pydantic's own messages say "Input should be a valid integer" at a tuple location; operators read YAML, so
each problem is rewritten as `cache.block_size: must be ...` and all problems of one file are reported at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

SECRET_KEYS = ("api_keys", "api_key")


class DeployConfigError(ValueError):
    """A deployment config that cannot be served; `problems` holds (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{key}: {message}" if key else message for key, message in problems]
        if len(lines) == 1:
            super().__init__(f"invalid deploy config{where}: {lines[0]}")
        else:
            body = "\n".join(f"  - {line}" for line in lines)
            super().__init__(f"invalid deploy config{where} ({len(lines)} problems):\n{body}")


class KeyProblem(ValueError):
    """Raised inside a section validator to blame one key of that section rather than the whole section."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def allowed_keys(model: type[BaseModel], loc: Iterable[str | int]) -> list[str]:
    """Field names of the section reached by following `loc` (minus its last element) from `model`."""
    current: Any = model
    for part in list(loc)[:-1]:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return []
        current = field.annotation
    return sorted(current.model_fields)


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _message(error: dict[str, Any], root: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        name = loc[-1]
        if name in SECRET_KEYS:
            return (
                "secrets are never read from the deploy file; put the keys in a file (one per line) and set "
                "server.api_keys_file, or in an environment variable (comma-separated) and set server.api_keys_env"
            )
        return f"unknown key; allowed keys here: {', '.join(allowed_keys(root, loc))}"
    if kind in ("model_type", "dict_type"):
        keys = allowed_keys(root, (*loc, ""))
        return f"must be a mapping of keys ({', '.join(keys)}), got {_describe(error['input'])}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    message = error["msg"]
    if message.startswith("Input should be"):
        message = "must be" + message[len("Input should be") :]
    return f"{message}, got {_describe(error['input'])}"


def from_validation_error(
    error: ValidationError,
    root: type[BaseModel],
    source: str | None = None,
    note: Callable[[str], str] = lambda key: "",
) -> DeployConfigError:
    """One DeployConfigError holding every pydantic problem; `note(key)` may add where a value came from."""
    problems: list[tuple[str, str]] = []
    for item in error.errors():
        loc = tuple(item["loc"])
        cause = item.get("ctx", {}).get("error")
        if isinstance(cause, KeyProblem):
            loc = (*loc, cause.key)
        key = ".".join(str(part) for part in loc)
        problems.append((key, _message(item, root, loc) + note(key)))
    return DeployConfigError(problems, source)
