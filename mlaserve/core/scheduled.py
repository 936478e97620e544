"""What a scheduled step holds: each request's rows (ScheduledRequest) and the step (SchedulerOutput). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step (prefix-cache hits included)
    block_ids: list[list[int]]  # the whole block table per cache group, after this step's allocation
    # Scheduled ahead (schedule_lookahead): this step's input is the token the step before it is still sampling,
    # so it is not in the request yet; the runner takes it from that step's device output.
    lookahead: bool = False
    # Speculative drafts run after the request's last known token (their slots are in num_new_tokens); the runner
    # checks each against the model's own token at the position before it.
    spec_token_ids: list[int] = field(default_factory=list)
    # A lookahead row behind a step that checks this many of the request's drafts: placed as if all of them hold
    # (its slots reserved for that), and its drafts are the draft model's from that step, not known yet either
    # (spec_token_ids are placeholders). settle() moves it back once the step's results are read.
    pending_drafts: int = 0
    settled: bool = True
    # Frozen at scheduling time so needs_sample stays right after update_from_output appends a token.
    _num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._num_tokens = self.request.num_tokens + self.lookahead + self.pending_drafts
        if self.pending_drafts and not self.lookahead:
            raise ValueError("ScheduledRequest.pending_drafts needs a lookahead row")

    def settle(self, num_accepted: int, drafts: list[int]) -> None:
        """The step before this one is read: num_accepted of its pending drafts held, and drafts are the draft
        model's drafts for this row (at least as many as the placeholders; a request that stopped there gets
        none, and its wasted row keeps its placeholders). The row moves back by the drafts rejected."""
        if self.settled:
            return
        if not 0 <= num_accepted <= self.pending_drafts:
            raise ValueError(f"num_accepted must be in 0..{self.pending_drafts}, got {num_accepted}")
        shift = self.pending_drafts - num_accepted
        self.num_computed_tokens -= shift
        self._num_tokens -= shift
        if drafts:
            if len(drafts) < len(self.spec_token_ids):
                raise ValueError(
                    f"request {self.request.request_id!r}: {len(drafts)} drafts for "
                    f"{len(self.spec_token_ids)} placeholder rows"
                )
            self.spec_token_ids = drafts[: len(self.spec_token_ids)]
        self.settled = True

    @property
    def needs_sample(self) -> bool:
        """This step reaches the last known token, so its logits give the next token."""
        return self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == self._num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
