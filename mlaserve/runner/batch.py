"""Turns the scheduler's output into the flat tensors one forward pass reads."""

from dataclasses import dataclass, field

import torch

from mlaserve.attention.metadata import AttentionMetadata, build_metadata
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.host_copy import queued_tensor, queued_values
from mlaserve.kvcache.spec import FULL, AttentionRule


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # decodes first, then prefills: the row order of the batch
    sample_rows: torch.Tensor  # [num_sampled] index of each sampled request's last token
    sampled: list[ScheduledRequest]  # requests that get a new token this step


@dataclass(slots=True)
class HostBatch:
    """A step's batch on the host, before any device copy: a captured decode graph copies it straight into its
    static buffers, everything else goes through to_device."""

    ids: list[int]
    positions: torch.Tensor  # [num_tokens] int64
    slots: torch.Tensor  # [num_tokens] int64: each token's row in the flattened cache
    tables: torch.Tensor  # [num_seqs, max_blocks] int32, zero-padded
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    order: list[ScheduledRequest]  # decodes first, then prefills: the row order of the batch
    sample_rows: list[int]  # index of each sampled request's last token
    sampled: list[ScheduledRequest]  # requests that get a new token this step
    # (tables, slots) of cache groups 1, 2, ... (tables and slots above are group 0's)
    other_groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Pooled-entries groups (AttentionRule.ratio) by index: the window-group slots of each entry's tokens, -1 before
    # the sequence's start (their `slots` are the entries' own, one per entry this step completes),
    pooled_sources: dict[int, torch.Tensor] = field(default_factory=dict)
    # and the position of each entry's first token (entry index x ratio), where its rotary applies.
    pooled_starts: dict[int, torch.Tensor] = field(default_factory=dict)


def _block_tables(block_lists: list[list[int]]) -> torch.Tensor:
    max_blocks = max(len(blocks) for blocks in block_lists)
    return torch.tensor([b + [0] * (max_blocks - len(b)) for b in block_lists], dtype=torch.int32)


def _tables_and_slots(
    block_lists: list[list[int]], rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _block_tables(block_lists)
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    return tables, slots


def entry_rows(
    tables: torch.Tensor,
    window_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    ratio: int,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: (done, slot, sources, start) of the entry of a pooled group (AttentionRule.ratio) that the token
    is in. done: the token is the entry's last, so this step writes the entry; tables hold `block_size` entries a
    block, window_tables are its window group's. sources: the window-group slots of the `span` tokens up to the
    token (AttentionRule.source_span), -1 before position 0; start: the position of the entry's first token."""
    done = (positions + 1) % ratio == 0
    entry = positions // ratio
    slots = tables[rows, entry // block_size].long() * block_size + entry % block_size
    # Its tokens: positions - span + 1 .. positions, all still in the window group (its window reaches that far).
    pos = positions[:, None] - span + 1 + torch.arange(span)
    inside = pos.clamp(min=0)
    sources = window_tables[rows[:, None], inside // block_size].long() * block_size + inside % block_size
    return done, slots, torch.where(pos >= 0, sources, -1), entry * ratio


def plan_batch(
    output: SchedulerOutput, block_size: int, rules: list[AttentionRule] | None = None
) -> HostBatch:
    # Decodes first: the attention layers split the batch at num_decodes.
    order = sorted(output.scheduled, key=lambda s: s.num_new_tokens != 1)
    num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []  # each token's row of the block table
    query_lens, seq_lens, sample_rows, sampled = [], [], [], []
    for row, s in enumerate(order):
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        if s.lookahead:  # a placeholder: the runner fills it on the device from the step still sampling it
            ids.append(0)
            ids.extend(s.spec_token_ids)  # a draft model's, settled before the batch is built
        else:  # known tokens, then any speculative drafts
            ids.extend(s.request.all_token_ids[start : end - len(s.spec_token_ids)])
            ids.extend(s.spec_token_ids)
        positions.extend(range(start, end))
        rows.extend([row] * s.num_new_tokens)
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        if s.needs_sample:
            sample_rows.append(len(ids) - 1)
            sampled.append(s)
    # One tensor per field, whatever the batch: a step of 256 sequences used to cost 256 small tensors and a
    # Python loop over every token (the slots), which showed at high concurrency.
    positions_t = torch.tensor(positions, dtype=torch.long)
    # Rows built in Python with the positions, not by torch.repeat_interleave: on the GPU host that op's
    # fixed cost was far above a Python loop's for a result this small.
    rows_t = torch.tensor(rows)
    rules = rules or [FULL] * len(order[0].block_ids)
    groups, pooled, starts = [], {}, {}
    for g, rule in enumerate(rules):
        if rule.ratio is None:
            groups.append(_tables_and_slots([s.block_ids[g] for s in order], rows_t, positions_t, block_size))
            continue
        # Built after its window group, which comes first (the engine appends the pooled groups).
        tables = _block_tables([s.block_ids[g] for s in order])
        window_tables, _ = groups[rules.index(rule.source_rule)]
        # the entries this step completes: each written by the step that computes its last token
        done, slots, sources, first = entry_rows(
            tables, window_tables, rows_t, positions_t, block_size, rule.ratio, rule.source_span
        )
        slots, pooled[g], starts[g] = slots[done], sources[done], first[done]
        groups.append((tables, slots))
    (tables, slots), others = groups[0], groups[1:]
    return HostBatch(
        ids,
        positions_t,
        slots,
        tables,
        query_lens,
        seq_lens,
        num_decodes,
        order,
        sample_rows,
        sampled,
        others,
        pooled,
        starts,
    )


def stage_token_rows(batch: HostBatch, size: int, host_i64: torch.Tensor) -> None:
    """Writes the batch's input ids, positions and slots into rows 0-2 of host_i64 [>= 3, >= size] and zeroes every
    row's columns from the batch's end to `size`: padding tokens are position 0 at slot 0 of the null block."""
    n = len(batch.ids)
    host_i64[0, :n] = torch.tensor(batch.ids)
    host_i64[1, :n] = batch.positions
    host_i64[2, :n] = batch.slots
    host_i64[:, n:size] = 0


def to_device(
    batch: HostBatch,
    block_size: int,
    device: torch.device,
    with_gather_index: bool = True,
    rules: list[AttentionRule] | None = None,
) -> ModelInput:
    """rules: each cache group's attention rule (window, sinks); one metadata per group."""
    rules = rules or [FULL] * (1 + len(batch.other_groups))
    metas = []
    for g, ((tables, slots), rule) in enumerate(
        zip([(batch.tables, batch.slots), *batch.other_groups], rules, strict=True)
    ):
        if rule.ratio is not None:  # read through its tables, written at its entry slots: no gather indices
            meta = AttentionMetadata(
                block_size, queued_tensor(slots, device), metas[0].seq_lens, queued_tensor(tables, device),
                batch.num_decodes, batch.query_lens, batch.seq_lens,
                pooled_sources=queued_tensor(batch.pooled_sources[g], device),
                pooled_starts=queued_tensor(batch.pooled_starts[g], device),
            )  # fmt: skip
        else:
            meta = build_metadata(
                block_size,
                queued_tensor(tables, device),
                batch.query_lens,
                batch.seq_lens,
                batch.num_decodes,
                queued_tensor(slots, device),
                with_gather_index,
                rule.window,
                rule.sinks,
            )
        metas.append(meta)
    meta = metas[0]
    if len(metas) > 1:
        meta.groups = metas
    return ModelInput(
        queued_values(batch.ids, torch.long, device),
        queued_tensor(batch.positions, device),
        meta,
        batch.order,
        queued_values(batch.sample_rows, torch.long, device),
        batch.sampled,
    )


def build_model_input(
    output: SchedulerOutput,
    block_size: int,
    device: torch.device,
    with_gather_index: bool = True,
    rules: list[AttentionRule] | None = None,
) -> ModelInput:
    return to_device(plan_batch(output, block_size, rules), block_size, device, with_gather_index, rules)
