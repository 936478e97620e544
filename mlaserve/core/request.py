"""One generation request as the scheduler and the KV-cache manager see it (token ids, progress, status)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mlaserve.core.block_hash import BlockHash


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The engine could not go on serving the request as asked (its grammar stopped being enforceable).
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM finish reason ("stop" | "length" | "abort" | "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",  # vLLM's name for it
}


@dataclass(slots=True, eq=False)
class Request:
    """A request's tokens and progress. Identity equality: two requests are never "equal" by content."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_index: int
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_params: object = None
    # False for a request that wants its prompt's logprobs: those need every prompt position's hidden state, so
    # it computes its whole prompt (its full blocks are still offered to the cache for others), as vLLM does.
    read_prefix_cache: bool = True
    # The scheduler may give it speculative drafts to verify (set by the engine for requests whose output keeps
    # exactly the plain engine's tokens, or their distribution, under verification: see runner/spec_verify.py).
    allow_drafts: bool = False
    # A draft model's proposals (the runner's MTP pass), made when the request had drafts_at tokens: they follow
    # those tokens, so the scheduler takes them only while the request still has exactly that many.
    draft_token_ids: list[int] = field(default_factory=list)
    drafts_at: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # time.monotonic() stamps for the serving metrics (queue, prefill and decode times): set by the engine when
    # the request arrives, by the scheduler when it is first scheduled, by the engine at its first token.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # group_id -> chained hashes of the full blocks of all_token_ids. Per group because the group id is
    # mixed into every hash and groups may use different block sizes. Token ids only ever grow, so the
    # lists are extended lazily and never invalidated (see block_hash.update_block_hashes).
    block_hashes: dict[int, list[BlockHash]] = field(default_factory=dict)
    # prompt + output in one list that is appended to, so hot paths never concatenate.
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens. The live list, not a copy: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
