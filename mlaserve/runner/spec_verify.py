"""Verifying speculative drafts in the step that runs them (greedy): the model's argmax at each draft's position.

A request with d drafts runs d + 1 tokens (its last known token, then the drafts). The logits at the first d of them
predict the tokens the drafts claim to be; the last one is the request's usual sampled row, whose token is the bonus
when every draft holds. Only greedy requests without logits processing get drafts (the engine decides), so the
argmax is the token the plain engine would have sampled at each position.
"""

from __future__ import annotations

from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.spec_decode.accept import greedy_accept


def draft_rows(order: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[int]]:
    """The requests in batch order that run drafts, and the batch rows whose logits check them (d per request,
    in the same order)."""
    drafted: list[ScheduledRequest] = []
    rows: list[int] = []
    row = 0
    for s in order:
        d = len(s.spec_token_ids)
        if d:
            first = row + s.num_new_tokens - d - 1  # the last known token's row
            drafted.append(s)
            rows.extend(range(first, first + d))
        row += s.num_new_tokens
    return drafted, rows


def accept_drafts(
    drafted: list[ScheduledRequest], verified: list[int], token_ids: dict[str, int]
) -> dict[str, int]:
    """Each drafted request's accepted draft count; its entry in token_ids (the token sampled after its last
    draft) becomes the model's token after the accepted ones. verified: draft_rows' argmax ids, in order."""
    num_accepted: dict[str, int] = {}
    offset = 0
    for s in drafted:
        rid, drafts = s.request.request_id, s.spec_token_ids
        targets = verified[offset : offset + len(drafts)]
        offset += len(drafts)
        if rid not in token_ids:
            continue
        out = greedy_accept(drafts, [*targets, token_ids[rid]])
        num_accepted[rid] = len(out) - 1
        token_ids[rid] = out[-1]
    return num_accepted
