"""runner/verify_graphs.py's rows: a verify step as one decode row per token, and which steps stay eager."""

import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.runner.batch import plan_batch
from mlaserve.runner.spec_verify import draft_rows
from mlaserve.runner.verify_graphs import run_captured, verify_as_decodes

BLOCK = 4


def scheduled(
    rid: int, tokens: int, drafts: list[int], blocks: list[int], new: int | None = None
) -> ScheduledRequest:
    """A request of `tokens` known tokens running its last one and `drafts` (or `new` tokens of its prompt)."""
    request = Request(str(rid), [10 * rid + i for i in range(tokens)], max_tokens=8, arrival_index=rid)
    new = len(drafts) + 1 if new is None else new
    computed = tokens - 1 if new == len(drafts) + 1 else 0
    return ScheduledRequest(request, new, computed, [blocks], spec_token_ids=list(drafts))


def step(*items: ScheduledRequest):
    return plan_batch(SchedulerOutput(list(items), sum(s.num_new_tokens for s in items), []), BLOCK)


def test_each_token_is_a_decode_row_over_its_requests_table() -> None:
    # no drafts, three drafts crossing a block edge, one draft
    batch = step(
        scheduled(0, 6, [], [3, 4]), scheduled(1, 7, [91, 92, 93], [5, 6, 7]), scheduled(2, 2, [94], [8])
    )
    rows = verify_as_decodes(batch)
    assert rows.num_decodes == len(rows.query_lens) == len(rows.ids) == 1 + 4 + 2
    assert rows.ids == batch.ids and torch.equal(rows.positions, batch.positions)
    assert torch.equal(rows.slots, batch.slots) and rows.sample_rows == batch.sample_rows == [0, 4, 6]
    assert rows.ids[1:5] == [16, 91, 92, 93] and rows.positions[1:5].tolist() == [6, 7, 8, 9]
    # row j of a request sees its context up to its own position: the causal mask among the request's rows
    assert rows.seq_lens == [6, 7, 8, 9, 10, 2, 3]
    want = [[3, 4, 0], [5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7], [8, 0, 0], [8, 0, 0]]
    assert rows.tables.tolist() == want


def test_steps_with_prompt_chunks_stay_eager() -> None:
    assert (
        verify_as_decodes(step(scheduled(0, 6, [1], [3, 4]), scheduled(1, 9, [], [5, 6, 7], new=9))) is None
    )


class Rows:
    """Graphs that return each row's index as its logits, to check which rows come back where."""

    def __init__(self, largest: int) -> None:
        self.largest, self.batches = largest, []

    def can_run(self, batch) -> bool:
        return batch.num_decodes == len(batch.query_lens) <= self.largest

    def run(self, batch, source=None, shift=None) -> torch.Tensor:
        self.batches.append(batch)
        return torch.arange(len(batch.ids), dtype=torch.float32)[:, None]

    def run_with_prenorm(self, batch, source=None, shift=None):
        logits = self.run(batch, source)
        return logits, -logits


def test_sampled_and_draft_rows_come_back_in_the_eager_paths_order() -> None:
    items = (
        scheduled(0, 6, [], [3, 4]),
        scheduled(1, 7, [91, 92, 93], [5, 6, 7]),
        scheduled(2, 2, [94], [8]),
    )
    batch = step(*items)
    _, verify_rows = draft_rows(batch.order)
    assert verify_rows == [1, 2, 3, 5]
    for keep_prenorm in (False, True):
        logits, drafts, prenorm = run_captured(Rows(8), batch, None, verify_rows, keep_prenorm)
        assert logits[:, 0].tolist() == [0, 4, 6] and drafts[:, 0].tolist() == [1, 2, 3, 5]
        assert (prenorm is None) != keep_prenorm
        if keep_prenorm:  # every row's, as the drafter indexes it by batch row
            assert prenorm[:, 0].tolist() == [-r for r in range(7)]
    assert run_captured(Rows(6), batch, None, verify_rows, False) is None  # 7 rows: past the largest graph
