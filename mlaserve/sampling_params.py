"""Per-request sampling settings, with vLLM's field names and defaults so user code ports unchanged."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Below this temperature the softmax is a spike on the argmax anyway; vLLM uses the same cut-off, and
# treating it as greedy avoids dividing logits by a near-zero number (inf/nan).
_GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    # bool is an int subclass, but logprobs=True (OpenAI style) or top_k=False are mistakes worth catching.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a grammar (vLLM's name and fields); exactly one field is set.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular expression;
    choice: one of these strings; grammar: a Lark grammar (llguidance's dialect)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {list(_STRUCTURED_KINDS)} set, got {chosen or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# OpenAI's documented range for logit_bias values; vLLM clamps, we reject, so a typo is not silently capped.
LOGIT_BIAS_LIMIT = 100.0


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
    # Log-probabilities of the prompt's own tokens (the first has none: None), with this many top tokens each.
    prompt_logprobs: int | None = None
    # Penalties as vLLM and OpenAI define them: presence / frequency count output tokens only; repetition
    # (CTRL-style: divide positive logits, multiply negative ones) covers prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # EOS and stop token ids (and stop strings) are held back until this many tokens were generated.
    min_tokens: int = 0
    # token id -> value added to its logit before sampling (OpenAI: -100 bans a token, 100 forces it).
    logit_bias: dict[int, float] | None = field(default=None)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # n > 1 is fanned out into n requests (engine/parallel_sampling.py); greedy n > 1 is allowed, as in vLLM.
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (samples of the prompt), got {self.n!r}")
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
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise ValueError(
                "prompt_logprobs must be an int >= 0 (0 = only the prompt's own token), or None, "
                f"got {self.prompt_logprobs!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        # Bounded so that logits divided or multiplied by it stay finite in float32 (and in bf16 logits).
        if not _is_real(rep) or not 0.01 <= rep <= 100:
            raise ValueError(f"repetition_penalty must be in [0.01, 100] (1 = off), got {rep!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(self.structured_outputs).__name__}"
            )
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

    @staticmethod
    def _normalise_logit_bias(bias: dict | None) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out = {}
        for key, value in bias.items():
            # JSON object keys are strings: "50256" is token 50256, as in OpenAI's API.
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
            if not _is_real(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}"
                )
            out[token] = float(value)
        return out or None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_processing(self) -> bool:
        """Whether logits are changed before sampling (penalties, bias, min_p, min_tokens, grammar)."""
        return (
            self.has_penalties
            or self.logit_bias is not None
            or self.min_p > 0
            or self.min_tokens > 0
            or self.structured_outputs is not None
        )

    @property
    def needs_history(self) -> bool:
        """Whether sampling needs the tokens generated so far on the host, so a step cannot be queued before the
        previous step's token is read (asynchronous scheduling stays off for it): a grammar advances by them.
        min_tokens and the penalties take a step queued ahead all the same (logits_processors.PendingTokens)."""
        return self.structured_outputs is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE
