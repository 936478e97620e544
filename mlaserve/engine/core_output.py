"""What the engine core reports per request per step: a delta, never a cumulative copy.

Small and picklable: it crosses a process boundary when the core runs in its own process (core_process.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.outputs import LogprobEntry


@dataclass(slots=True)
class CoreOutput:
    request_id: str
    new_token_ids: list[int]
    # One dict per new token (token id -> log-probability) when the request asked for logprobs.
    new_logprobs: list[LogprobEntry] | None = None
    # Set on a request's last output: "stop" | "length" | "abort".
    finish_reason: str | None = None
    # The stop token id that ended it (a stop string is found, and named, by the reader of the text).
    stop_reason: int | None = None
    # With SamplingParams(prompt_logprobs=k): the prompt's logprobs, once, with the first new token.
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict | None = None  # on the last output: time.monotonic() stamps of the request's phases

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:
        # The fields as one tuple: pickling a slots dataclass goes through copyreg's state dict per object, which
        # cost the core several times this per step with hundreds of requests
        return (
            CoreOutput,
            (
                self.request_id,
                self.new_token_ids,
                self.new_logprobs,
                self.finish_reason,
                self.stop_reason,
                self.prompt_logprobs,
                self.num_cached_tokens,
                self.metrics,
            ),
        )
