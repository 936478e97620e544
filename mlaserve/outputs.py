"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes, so callers port unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token (token id -> log-probability), only when SamplingParams.logprobs is set.
    logprobs: list[dict[int, float]] | None
    # "stop" (EOS, stop string or stop token) | "length" (max_tokens / max_model_len) | None while running.
    finish_reason: str | None
    # The stop token id or stop string that ended the sequence; None for EOS or length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict | None = None
    # With SamplingParams(prompt_logprobs=k): one dict per prompt token (its own id first, then the top k), the
    # first None (nothing precedes it), as vLLM returns them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
