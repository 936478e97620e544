"""Per-request sampling settings, with vLLM's field names and defaults so user code ports unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature the softmax is a spike on the argmax anyway; vLLM uses the same cut-off, and
# treating it as greedy avoids dividing logits by a near-zero number (inf/nan).
_GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    # bool is an int subclass, but logprobs=True (OpenAI style) or top_k=False are mistakes worth catching.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1 (only one completion per request is supported), got {self.n!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        # The negated form also rejects NaN, which fails every comparison.
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an int >= 1, or None for up to max_model_len, got {self.max_tokens!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(
                f"logprobs must be an int >= 0 (0 = only the sampled token), or None, got {self.logprobs!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            # An empty stop string would match at every position and end generation at once.
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {s!r}")
        return stops

    @staticmethod
    def _normalise_stop_token_ids(ids: list[int] | None) -> list[int]:
        if ids is None:
            return []
        ids = list(ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {t!r}")
        return ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE
