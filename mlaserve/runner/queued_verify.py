"""A step queued behind a verify step (asynchronous scheduling with a draft model): its rows of the requests that
step samples were scheduled before the step's accepted drafts were known, placed as if every draft held, with
placeholder drafts for the draft model's pass after it (Scheduler.schedule_lookahead, ScheduledRequest.settle).

Two ways to launch it. Where the verify step's draft pass was captured (its drafts are on the device) and the
queued step replays the decode graphs, nothing waits: accept_on_device finds each request's accepted count and next
token from the verify step's device outputs, the lookahead rows take those tokens and the pass's drafts as input ids,
and correct_rows moves each row back by the drafts rejected (positions, cache slots, the lengths it sees) in the
graphs' static inputs before the replay; the host settles the rows when it reads the verify step. Otherwise the
reference way: read the verify step first (its collection, kept for the engine's own collect), settle the rows and
plan the batch from them; the host then waits for that step, but its scheduling and the engine's bookkeeping of the
step before still overlap the device. Both give the same rows (tests/runner/test_queued_verify.py, and the engine
tests through both paths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.host_copy import queued_values
from mlaserve.kvcache.spec import AttentionRule
from mlaserve.runner.batch import HostBatch, plan_batch
from mlaserve.runner.prompt_logprobs import prompt_spans
from mlaserve.runner.step import LaunchedStep, StepResult
from mlaserve.runner.verify_graphs import CapturedDecode, verify_as_decodes


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


def accept_on_device(
    drafted: list[ScheduledRequest],
    sampled: list[ScheduledRequest],
    targets: torch.Tensor,
    bonus: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """spec_verify.accept_drafts on the device, for a step whose results are not read yet: per sampled request (in
    the order of its sampled rows), (the drafts it rejects, its next input token: the first rejected draft's target,
    or the bonus token). drafted: its requests with drafts, in batch order (settled: their drafts are on the host);
    targets: their draft targets (spec_verify.draft_targets); bonus: each sampled request's sampled token."""
    device = bonus.device
    counts = {s.request.request_id: len(s.spec_token_ids) for s in drafted}
    widest = max(counts.values(), default=0)
    if widest == 0:
        return torch.zeros_like(bonus), bonus
    offsets, offset = {}, 0
    for s in drafted:
        offsets[s.request.request_id] = offset
        offset += len(s.spec_token_ids)
    index, num = [], []
    for s in sampled:
        rid = s.request.request_id
        first, d = offsets.get(rid, 0), counts.get(rid, 0)
        index.append([first + j if j < d else -1 for j in range(widest)])
        num.append(d)
    index_t = queued_values(index, torch.long, device)
    num_t = queued_values(num, torch.long, device)
    drafts = queued_values([t for s in drafted for t in s.spec_token_ids], torch.long, device)
    safe = index_t.clamp(min=0)
    held = (drafts[safe] == targets[safe]) & (index_t >= 0)
    accepted = held.long().cumprod(dim=1).sum(dim=1)
    at = safe.gather(1, accepted.clamp(max=widest - 1).unsqueeze(1)).squeeze(1)
    return num_t - accepted, torch.where(accepted < num_t, targets[at], bonus)


def correct_rows(
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    shift: torch.Tensor,
    block_size: int,
) -> None:
    """Moves a decode batch's first rows (one per token, each its own sequence; shift: [rows], the drafts their
    request's verify step rejected) back in place: positions, their cache slots through the rows' tables, and the
    lengths they see. Rows behind no verify step have a shift of 0 and stay as they are."""
    n = shift.shape[0]
    pos = positions[:n]
    pos.sub_(shift)
    block = tables[:n].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    slots[:n] = block * block_size + pos % block_size
    seq_lens[:n] = (pos + 1).to(seq_lens.dtype)


@dataclass(slots=True)
class BehindInputs:
    """A step queued behind an unread verify step, run without settling its rows on the host: what the device
    corrects before its forward (the decode graphs' replay)."""

    source_ids: (
        torch.Tensor
    )  # the verify step's sampled requests' next input tokens, then its draft pass's drafts
    source_rows: list[
        int
    ]  # per token: its index in source_ids, -1 where the host knows it (model_runner's form)
    shift: torch.Tensor  # per token: the drafts its request's verify step rejects (0 for rows behind none)


def can_queue_behind(output: SchedulerOutput, previous: LaunchedStep) -> bool:
    """Whether `output`'s unsettled rows can run before `previous` is read: its drafts are on the device (its
    captured draft pass) and every unsettled row is greedy (rejection sampling reads the drafts on the host)."""
    unsettled = [s for s in output.scheduled if not s.settled]
    return (
        bool(unsettled)
        and previous.queued_drafts is not None
        and previous.queued_drafts.on_device is not None
        and all(s.request.sampling_params.is_greedy for s in unsettled)
    )


def inputs_behind(host: HostBatch, previous: LaunchedStep) -> BehindInputs:
    """The device-side inputs of `host` (planned from unsettled rows: placed as if every draft held, placeholder
    drafts) behind `previous`, unread: accept_on_device's next tokens and shifts, and the draft pass's drafts."""
    targets = previous.verified if previous.verified is not None else previous.token_ids
    shifts, next_ids = accept_on_device(previous.drafted, previous.sampled, targets, previous.token_ids)
    queued = previous.queued_drafts
    num_sampled, width = len(previous.sampled), queued.on_device.shape[1]
    sampled_row = {s.request.request_id: i for i, s in enumerate(previous.sampled)}
    pass_row = {s.request.request_id: i for i, (s, _) in enumerate(queued.requests)}
    source_rows: list[int] = []
    shift_rows: list[int] = []
    for s in host.order:
        rid, n = s.request.request_id, s.num_new_tokens
        if not s.lookahead:
            source_rows += [-1] * n
        elif s.settled:  # a plain lookahead row: no drafts
            source_rows += [sampled_row[rid]] + [-1] * (n - 1)
        else:
            drafts = range(num_sampled + pass_row[rid] * width, num_sampled + pass_row[rid] * width + n - 1)
            source_rows += [sampled_row[rid], *drafts]
        shift_rows += [num_sampled if s.settled else sampled_row[rid]] * n
    source_ids = torch.cat((next_ids, queued.on_device.reshape(-1)))
    padded = torch.cat((shifts, torch.zeros(1, dtype=shifts.dtype, device=shifts.device)))
    shift = padded[queued_values(shift_rows, torch.long, padded.device)]
    return BehindInputs(source_ids, source_rows, shift)


def plan_step(
    output: SchedulerOutput,
    previous: LaunchedStep | None,
    graphs: CapturedDecode | None,
    block_size: int,
    rules: list[AttentionRule],
    collect: Callable[[LaunchedStep], StepResult],
) -> tuple[HostBatch, BehindInputs | None, torch.Tensor | None]:
    """A step's batch, the device's corrections of its rows queued behind `previous` unread (None when there are
    none, or when `previous` is read first (collect) and they are settled: the step does not fit the graphs, or
    `previous`'s drafts are not on the device), and the ids its lookahead rows take (indexed by `previous`'s
    sampled rows). `previous`'s eager draft pass is read first too: this step's pass reads its cache rows."""
    if previous is None:
        return plan_batch(output, block_size, rules), None, None
    if graphs is not None and can_queue_behind(output, previous):
        host = plan_batch(output, block_size, rules)
        rows = verify_as_decodes(host)
        if rows is not None and graphs.can_run(rows) and not prompt_spans(host.order):
            behind = inputs_behind(host, previous)
            previous.queued_behind = output  # settled when `previous` is read
            return host, behind, behind.source_ids
    previous_ids = previous.token_ids
    if any(not s.settled for s in output.scheduled) or previous.prenorm is not None:
        previous.result = collect(previous)
        settle_rows(output, previous.result)
        previous_ids = tokens_after_drafts(previous, previous.result, previous_ids.device)
    return plan_batch(output, block_size, rules), None, previous_ids
