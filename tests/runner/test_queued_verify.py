"""runner/queued_verify.py against its host-side references: accept_on_device gives accept_drafts' counts and
tokens, and correct_rows moves unsettled rows to where planning them after settle() puts them."""

import random

import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.runner.batch import plan_batch
from mlaserve.runner.queued_verify import accept_on_device, correct_rows
from mlaserve.runner.spec_verify import accept_drafts
from mlaserve.runner.verify_graphs import verify_as_decodes

BLOCK = 4


def request(rid: int, tokens: int) -> Request:
    return Request(str(rid), [10 * rid + i + 1 for i in range(tokens)], max_tokens=32, arrival_index=rid)


def test_accepted_counts_and_next_tokens_equal_accept_drafts() -> None:
    rng = random.Random(0)
    for _ in range(50):
        sampled = []
        for rid in range(rng.randint(1, 6)):
            drafts = [rng.randrange(4) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
            sampled.append(
                ScheduledRequest(request(rid, 5), 1 + len(drafts), 4, [[1, 2, 3]], spec_token_ids=drafts)
            )
        drafted = [s for s in sampled if s.spec_token_ids]
        # targets that often equal the drafts (small vocabulary), so every accepted count shows up
        targets = [rng.randrange(4) for s in drafted for _ in s.spec_token_ids]
        bonus = [rng.randrange(100, 200) for _ in sampled]
        token_ids = {s.request.request_id: b for s, b in zip(sampled, bonus, strict=True)}
        num_accepted = accept_drafts(drafted, targets, token_ids)
        shifts, next_ids = accept_on_device(
            drafted, sampled, torch.tensor(targets or [0]), torch.tensor(bonus)
        )
        want_shifts = [len(s.spec_token_ids) - num_accepted.get(s.request.request_id, 0) for s in sampled]
        assert shifts.tolist() == want_shifts
        assert next_ids.tolist() == [token_ids[s.request.request_id] for s in sampled]


def unsettled(rid: int, tokens: int, pending: int, drafts: int, blocks: list[int]) -> ScheduledRequest:
    """A lookahead row of a request with `tokens` known tokens, behind a step that checks `pending` drafts and
    samples one token: placed as if every draft held, with `drafts` placeholder drafts."""
    item = ScheduledRequest(
        request(rid, tokens), 1 + drafts, tokens + pending, [blocks], lookahead=True,
        spec_token_ids=[0] * drafts, pending_drafts=pending, settled=False,
    )  # fmt: skip
    assert item.needs_sample
    return item


def staged(items: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = verify_as_decodes(
        plan_batch(SchedulerOutput(items, sum(s.num_new_tokens for s in items), []), BLOCK)
    )
    return (
        rows.positions.clone(),
        rows.slots.clone(),
        torch.tensor(rows.seq_lens, dtype=torch.int32),
        rows.tables,
    )


def test_corrected_rows_equal_rows_planned_after_settling() -> None:
    # Behind 3 drafts (1 held, 2 drafts next), behind 2 (both held), behind none (its own drafts only), and a
    # request the step before did not run (known tokens, a draft of its own).
    items = [
        unsettled(0, 9, 3, 2, [5, 6, 7, 8]),
        unsettled(1, 6, 2, 1, [9, 10, 11]),
        unsettled(2, 3, 0, 2, [12, 13]),
        ScheduledRequest(request(3, 5), 2, 4, [[14, 15]], spec_token_ids=[77]),
    ]
    positions, slots, seq_lens, tables = staged(items)
    accepted = [1, 2, 0]
    shift = torch.tensor([3 - 1] * 3 + [0] * 2 + [0] * 3 + [0] * 2)
    correct_rows(positions, slots, seq_lens, tables, shift, BLOCK)
    for item, a in zip(items, accepted):
        item.settle(a, [41, 42, 43])
    want_positions, want_slots, want_seq_lens, _ = staged(items)
    assert positions.tolist() == want_positions.tolist() and positions[:3].tolist() == [10, 11, 12]
    assert slots.tolist() == want_slots.tolist() and seq_lens.tolist() == want_seq_lens.tolist()
