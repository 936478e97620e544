"""Turns the scheduler's output into the flat tensors one forward pass reads."""

from dataclasses import dataclass

import torch

from mlaserve.attention.metadata import AttentionMetadata, build_metadata
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # decodes first, then prefills: the row order of the batch
    sample_rows: torch.Tensor  # [num_sampled] index of each sampled request's last token
    sampled: list[ScheduledRequest]  # requests that get a new token this step


def build_model_input(
    output: SchedulerOutput, block_size: int, device: torch.device, with_gather_index: bool = True
) -> ModelInput:
    # Decodes first: the attention layers split the batch at num_decodes.
    order = sorted(output.scheduled, key=lambda s: s.num_new_tokens != 1)
    num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens, seq_lens, sample_rows, sampled = [], [], [], []
    max_blocks = max(len(s.block_ids[0]) for s in order)
    tables = torch.zeros(len(order), max_blocks, dtype=torch.int32)
    for row, s in enumerate(order):
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        blocks = s.block_ids[0]
        ids.extend(s.request.all_token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        query_lens.append(s.num_new_tokens)
        seq_lens.append(end)
        if s.needs_sample:
            sample_rows.append(len(ids) - 1)
            sampled.append(s)
    as_long = dict(dtype=torch.long, device=device)
    meta = build_metadata(
        block_size,
        tables.to(device),
        query_lens,
        seq_lens,
        num_decodes,
        torch.tensor(slots, **as_long),
        with_gather_index,
    )
    return ModelInput(
        torch.tensor(ids, **as_long),
        torch.tensor(positions, **as_long),
        meta,
        order,
        torch.tensor(sample_rows, **as_long),
        sampled,
    )
