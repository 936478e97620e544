"""SpeculativeOptions: vLLM's `speculative_config`, the engine's speculative decoding as a typed section.

Two methods: prompt lookup ("ngram"), whose drafts come from the request's own tokens, and "mtp" (DeepSeek-V3's
multi-token-prediction layer, shipped in its checkpoints, run as the draft model; vLLM's name "deepseek_mtp" is
taken for it). The lookup bounds belong to "ngram" alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

METHODS = ("ngram", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}
# vLLM's defaults when neither prompt_lookup bound is given (its SpeculativeConfig picks the same value).
_DEFAULT_LOOKUP = 5


class SpeculativeOptionError(ValueError):
    """A bad speculative_config value; key names it, so the deploy file can blame its own key."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        super().__init__(f"invalid engine option speculative_config[{key!r}]={value!r}: must be {allowed}")
        self.key = key
        self.allowed = allowed
        self.value = value


def _problem(key: str, value: object, allowed: str) -> SpeculativeOptionError:
    return SpeculativeOptionError(key, value, allowed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeOptions:
    """None of them set: no speculation. The lookup bounds, as vLLM resolves them: both unset take its default,
    one unset takes the other's value."""

    method: str | None = None  # "ngram" | "mtp"
    num_speculative_tokens: int | None = None  # drafts proposed per request per step
    prompt_lookup_min: int | None = None  # shortest suffix n-gram that is looked up
    prompt_lookup_max: int | None = None  # longest, tried first

    @classmethod
    def from_value(cls, value: object) -> SpeculativeOptions:
        """From LLM(speculative_config=...): None, a dict of vLLM's keys, or SpeculativeOptions itself."""
        if value is None:
            return cls()
        if isinstance(value, SpeculativeOptions):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(
                f"speculative_config must be a dict (vLLM's keys) or None, got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"unknown speculative_config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**value)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def as_dict(self) -> dict[str, object] | None:
        """vLLM's dict (its set keys), or None when speculation is off."""
        if not self.enabled:
            return None
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def __post_init__(self) -> None:
        method, k = self.method, self.num_speculative_tokens
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method is None:
            for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise _problem("method", None, f"one of {list(METHODS)} when {name} is set")
            return
        if method in ALIASES:
            method = ALIASES[method]
            object.__setattr__(self, "method", method)
        if method not in METHODS:
            raise _problem("method", method, f"one of {list(METHODS)} (or {list(ALIASES)})")
        if not _is_int(k) or k < 1:
            raise _problem("num_speculative_tokens", k, "an int >= 1")
        if method == "mtp":
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    raise _problem(name, value, "unset with method 'mtp' (it bounds the n-gram lookup)")
            return
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise _problem(name, value, "an int >= 1")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise _problem("prompt_lookup_min", lo, f"at most prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
