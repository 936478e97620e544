"""build_model_input against a per-token reference: ids, positions, slots, block tables, row order, sample rows."""

import random

import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.runner.batch import build_model_input

BLOCK = 4


def scheduled(rid: int, prompt_len: int, computed: int, new: int, blocks: list[int]) -> ScheduledRequest:
    request = Request(
        str(rid), [100 + rid * 50 + i for i in range(prompt_len)], max_tokens=8, arrival_index=rid
    )
    return ScheduledRequest(request, num_new_tokens=new, num_computed_tokens=computed, block_ids=[blocks])


def test_matches_a_per_token_reference():
    rng = random.Random(0)
    free = list(range(1, 200))
    rng.shuffle(free)
    items = []
    for rid in range(12):
        prompt_len = rng.randint(1, 30)
        computed = rng.randint(0, prompt_len - 1)
        new = 1 if rid % 3 == 0 else prompt_len - computed  # decodes (one token) mixed with prefill chunks
        if new == 1:
            computed = prompt_len - 1
        blocks = [free.pop() for _ in range(-(-(computed + new) // BLOCK))]
        items.append(scheduled(rid, prompt_len, computed, new, blocks))
    out = SchedulerOutput(items, sum(s.num_new_tokens for s in items), [])
    batch = build_model_input(out, BLOCK, torch.device("cpu"))

    order = sorted(items, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
    assert batch.order == order and batch.meta.num_decodes == sum(s.num_new_tokens == 1 for s in items)
    want_ids, want_pos, want_slots, want_rows = [], [], [], []
    for s in order:
        blocks = s.block_ids[0]
        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            want_ids.append(s.request.all_token_ids[p])
            want_pos.append(p)
            want_slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        want_rows.append(len(want_ids) - 1)  # every item here reaches its last known token
    assert batch.input_ids.tolist() == want_ids
    assert batch.positions.tolist() == want_pos
    assert batch.meta.slot_mapping.tolist() == want_slots
    assert batch.sample_rows.tolist() == want_rows
    for row, s in enumerate(order):
        blocks = s.block_ids[0]
        assert batch.meta.block_tables[row, : len(blocks)].tolist() == blocks
        assert batch.meta.block_tables[row, len(blocks) :].eq(0).all()
    assert batch.meta.host_seq_lens == [s.num_computed_tokens + s.num_new_tokens for s in order]


def test_entries_a_step_completes_name_their_tokens_and_nothing_before_the_start():
    """entry_rows: a rate-2 group pooling 4 tokens (V4's overlapping span), block size 2, one sequence whose
    step computes positions 0-4: entries 0 and 1 complete; entry 0's span starts two tokens before position 0."""
    from mlaserve.runner.batch import entry_rows

    window_tables = torch.tensor(
        [[5, 6, 7]], dtype=torch.int32
    )  # positions 0-1 in block 5, 2-3 in 6, 4-5 in 7
    entry_tables = torch.tensor([[9, 4]], dtype=torch.int32)  # 2 entries (4 tokens) a block
    rows, positions = torch.zeros(5, dtype=torch.long), torch.arange(5)
    done, slots, sources, starts = entry_rows(entry_tables, window_tables, rows, positions, 2, 2, span=4)
    assert done.tolist() == [False, True, False, True, False]
    assert slots[done].tolist() == [18, 19] and slots[4].item() == 4 * 2  # position 4: entry 2, block 4
    assert sources[done].tolist() == [[-1, -1, 10, 11], [10, 11, 12, 13]]
    assert starts.tolist() == [0, 0, 2, 2, 4]
