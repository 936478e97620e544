"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes, so callers port unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, as vLLM returns it: rank is 1-based among the whole vocabulary (the number
    of tokens at least as likely), decoded_token the token's own text (tokenizer.decode of it alone)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __reduce__(self) -> tuple:
        # A plain tuple: the engine core's process pickles one per token and top token (see CoreOutput)
        return (Logprob, (self.logprob, self.rank, self.decoded_token))


# token id -> its Logprob, for one position: the sampled (or prompt) token first, then the top tokens.
LogprobEntry = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token (token id -> Logprob), only when SamplingParams.logprobs is set.
    logprobs: list[LogprobEntry] | None
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
    prompt_logprobs: list[LogprobEntry | None] | None = None
