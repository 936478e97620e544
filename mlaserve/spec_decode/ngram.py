"""Prompt-lookup (n-gram) drafts: the tokens that followed the most recent earlier occurrence of the sequence's
last n tokens, n from prompt_lookup_max down to prompt_lookup_min (the longest match wins). Pure Python.

The search runs backwards from the end, so the most recent match is found first and a request that repeats itself
recently (code, quoted text, lists) pays little; a sequence with no match scans it once per n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.core.request import Request


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max or self.num_speculative_tokens < 1:
            raise ValueError(f"NgramProposer needs 1 <= min <= max and k >= 1, got {self}")

    # No cache rows of its own: nothing past the drafts' slots, and any prefix-cache hit serves.
    num_lookahead_slots = 0
    reads_next_token = False

    def drafts_for(self, request: Request, max_tokens: int) -> list[int]:
        return self.propose(request.all_token_ids, max_tokens)

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) drafts to follow token_ids; empty when no suffix n-gram recurs."""
        k = (
            self.num_speculative_tokens
            if max_tokens is None
            else min(self.num_speculative_tokens, max_tokens)
        )
        if k <= 0:
            return []
        n_tokens = len(token_ids)
        for n in range(min(self.prompt_lookup_max, n_tokens - 1), self.prompt_lookup_min - 1, -1):
            start = find_earlier(token_ids, n)
            if start >= 0:
                follow = start + n
                return list(token_ids[follow : follow + k])
        return []


def find_earlier(token_ids: Sequence[int], n: int) -> int:
    """Start of the most recent occurrence of the last n tokens that ends before the last token; -1 if none."""
    end = len(token_ids)
    if n < 1 or n >= end:
        return -1
    suffix = list(token_ids[end - n :])
    last = suffix[-1]
    # Candidate ends i (exclusive) run from end - 1 down to n: a match token_ids[i - n : i] == suffix.
    for i in range(end - 1, n - 1, -1):
        if token_ids[i - 1] == last and list(token_ids[i - n : i]) == suffix:
            return i - n
    return -1
