"""Drafts a draft model made at the end of the step before (the runner's MTP pass), kept on the request until
the scheduler hands them to the next step. Pure Python: the scheduler reads it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.core.request import Request


@dataclass(frozen=True)
class ModelDrafts:
    num_speculative_tokens: int

    # The cache rows the draft layer writes for its own drafts after the first sit past the verified tokens: a
    # step that drafts needs that many slots more.
    @property
    def num_lookahead_slots(self) -> int:
        return self.num_speculative_tokens - 1

    # The draft layer's row at a position is made from the token after it, so a prefix-cache hit can only serve
    # rows whose next token it also matched (KVCacheManager.drop_last_hit_block).
    reads_next_token = True

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"ModelDrafts needs k >= 1, got {self.num_speculative_tokens}")

    def drafts_for(self, request: Request, max_tokens: int) -> list[int]:
        """Up to max_tokens of the request's drafts, or none when they were made for other tokens than it has
        now (a step that yielded tokens without drafting after them)."""
        if request.drafts_at != request.num_tokens or max_tokens <= 0:
            return []
        return request.draft_token_ids[:max_tokens]
