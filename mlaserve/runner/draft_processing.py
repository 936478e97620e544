"""Draft rows processed as the plain engine processes a row: as if the drafts before them had been generated.

A verify step runs a request's last known token and its d drafts; the logits at draft row j (j = 0 .. d - 1) and
at the sampled row (j = d) predict the token after drafts 0 .. j - 1. The plain engine would reach that row only
after generating those drafts, so row j is processed with them counted: min_tokens holds EOS and the stop ids back
while the output would be shorter than min_tokens, the penalties count them among the output tokens, and a
grammar's mask is its state after consuming them (Grammar.draft_masks computes every state, then rolls the
matcher back; it advances in collect by the tokens the step keeps). A draft the grammar cannot take ends the
drafts there: the rows past it get the mask of the last state it reached, and no draft past it is accepted.

Logprobs are the plain engine's too: the raw logits' (before any processing, as the sampler reports them) at the
row each kept token was chosen at, so a drafted request gets one entry per token it keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.outputs import LogprobEntry
from mlaserve.sampling.logits_processors import FixedMask, TokenMask, process_logits
from mlaserve.sampling.structured_output import Grammar
from mlaserve.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftGrammar:
    """A drafted request's grammar states along its drafts: masks[j] before row j's token, for j up to
    num_valid (the drafts the grammar takes, in order); the rows past num_valid reuse masks[num_valid]."""

    masks: list[FixedMask]
    num_valid: int

    def mask(self, row: int) -> FixedMask:
        return self.masks[min(row, self.num_valid)]


def draft_grammars(
    grammars: dict[str, Grammar], drafted: list[ScheduledRequest], vocab_size: int
) -> dict[str, DraftGrammar]:
    """The grammar states of the drafted requests that have a grammar."""
    out: dict[str, DraftGrammar] = {}
    for s in drafted:
        grammar = grammars.get(s.request.request_id)
        if grammar is not None:
            masks, valid = grammar.draft_masks(list(s.spec_token_ids), vocab_size)
            out[s.request.request_id] = DraftGrammar([FixedMask(m) for m in masks], valid)
    return out


def sampled_row_inputs(
    sampled: list[ScheduledRequest],
    masks: list[TokenMask | None],
    walks: dict[str, DraftGrammar],
) -> tuple[list[TokenMask | None], list[Sequence[int]]]:
    """For the step's sampled rows: each row's mask (a drafted request's state after all its drafts) and the
    drafts before it (none for a request without drafts)."""
    masks = list(masks)
    for i, s in enumerate(sampled):
        walk = walks.get(s.request.request_id)
        if walk is not None:
            masks[i] = walk.mask(len(s.spec_token_ids))
    return masks, [s.spec_token_ids for s in sampled]


def draft_row_params(drafted: list[ScheduledRequest]) -> list[SamplingParams]:
    """Each draft row's sampling params, in draft_rows' order."""
    return [s.request.sampling_params for s in drafted for _ in s.spec_token_ids]


def process_draft_rows(
    logits: torch.Tensor, drafted: list[ScheduledRequest], walks: dict[str, DraftGrammar]
) -> torch.Tensor:
    """The draft rows' logits (draft_rows' rows, in order) processed as the plain engine would process each: a
    processed copy, or the logits themselves when no row needs it. logit_bias, which reads no history, is among
    what process_logits adds."""
    params = draft_row_params(drafted)
    requests, masks, before = [], [], []
    for s in drafted:
        walk = walks.get(s.request.request_id)
        for j in range(len(s.spec_token_ids)):
            requests.append(s.request)
            masks.append(None if walk is None else walk.mask(j))
            before.append(s.spec_token_ids[:j])
    return process_logits(logits, params, requests, masks, None, before)


def kept_logprobs(
    drafted: list[ScheduledRequest],
    row_entries: list[LogprobEntry | None],
    num_accepted: dict[str, int],
    sampled_entries: dict[str, LogprobEntry],
) -> dict[str, list[LogprobEntry]]:
    """One entry per token each drafted request keeps: its accepted drafts' rows, then the row of the token after
    them (the first rejected draft's row, or the sampled row when every draft held). row_entries: the draft rows'
    entries, in draft_rows' order (None for a request that asks for none); sampled_entries: the sampled rows'."""
    out: dict[str, list[LogprobEntry]] = {}
    offset = 0
    for s in drafted:
        rid, d = s.request.request_id, len(s.spec_token_ids)
        rows, offset = row_entries[offset : offset + d], offset + d
        if rid not in num_accepted or s.request.sampling_params.logprobs is None:
            continue
        n = num_accepted[rid]
        out[rid] = rows[: n + 1] if n < d else [*rows, sampled_entries[rid]]
    return out
