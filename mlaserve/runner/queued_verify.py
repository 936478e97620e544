"""A step queued behind a verify step (asynchronous scheduling with a draft model): its rows of the requests that
step samples were scheduled before the step's accepted drafts were known, placed as if every draft held, with
placeholder drafts for the draft model's pass after it (Scheduler.schedule_lookahead, ScheduledRequest.settle).

This is the reference way to launch it: read the step before on the host first (its collection, kept for the
engine's own collect), settle each row (moved back by the drafts rejected, its drafts filled in), and feed each
lookahead row the token after the accepted drafts. The host then waits for that step before it launches this one,
but its scheduling and the engine's bookkeeping of the step before still overlap the device. A faster way, not built
yet, leaves the rows unsettled on the host and corrects their positions, slots, lengths and input ids on the device
from the step's accepted counts before the forward or graph replay; it must give this one's tokens.
"""

from __future__ import annotations

import torch

from mlaserve.core.scheduler import SchedulerOutput
from mlaserve.host_copy import queued_values
from mlaserve.runner.step import LaunchedStep, StepResult


def settle_rows(output: SchedulerOutput, result: StepResult) -> None:
    """Settles every unsettled row of `output` with the results of the step it was queued behind. A request that
    got no result there (aborted) keeps its placeholders: its row is skipped when `output` is applied."""
    for s in output.scheduled:
        if s.settled:
            continue
        rid = s.request.request_id
        accepted = result.num_accepted.get(rid, 0) if rid in result.token_ids else s.pending_drafts
        s.settle(accepted, result.drafts.get(rid, (0, []))[1])


def tokens_after_drafts(previous: LaunchedStep, result: StepResult, device: torch.device) -> torch.Tensor:
    """Each of `previous`'s sampled requests' next input token (after its accepted drafts: the first rejected
    draft's replacement, or the bonus token), in the order of its sampled rows, on the device."""
    return queued_values([result.token_ids.get(s.request.request_id, 0) for s in previous.sampled], torch.long,
                         device)  # fmt: skip
