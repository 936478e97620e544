"""A step's plan crosses to the other tensor-parallel ranks pickled (runner/model_runner.py StepPlan): every field of
its batch survives, the tensors as tensors."""

import dataclasses
import pickle

import torch

from mlaserve.runner.batch import HostBatch
from mlaserve.runner.prompt_logprobs import PromptSpan
from mlaserve.runner.step import StepPlan


def test_round_trip_keeps_every_field_of_the_batch() -> None:
    host = HostBatch(
        ids=[5, 6, 7],
        positions=torch.tensor([9, 0, 1]),
        slots=torch.tensor([41, 64, 65]),
        tables=torch.tensor([[2, 3], [4, 0]], dtype=torch.int32),
        query_lens=[1, 2],
        seq_lens=[10, 2],
        num_decodes=1,
        order=[],
        sample_rows=[0, 2],
        sampled=[],
        other_groups=[
            (torch.tensor([[7], [8]], dtype=torch.int32), torch.tensor([112, 128, 129])),
            (torch.tensor([[9], [10]], dtype=torch.int32), torch.tensor([147])),
        ],
        pooled_sources={2: torch.tensor([[128, 129]])},
        pooled_starts={2: torch.tensor([8])},
    )
    # a field added to HostBatch must be carried by StepPlan.__reduce__ (and checked here)
    assert [f.name for f in dataclasses.fields(HostBatch)] == [
        "ids", "positions", "slots", "tables", "query_lens", "seq_lens", "num_decodes", "order", "sample_rows",
        "sampled", "other_groups", "pooled_sources", "pooled_starts",
    ]  # fmt: skip
    spans = [PromptSpan("r1", 1, 1, [6, 7], 2)]
    back = pickle.loads(pickle.dumps(StepPlan(host, spans, [1, 0], [1])))
    assert back.spans == spans and back.source_rows == [1, 0] and back.verify_rows == [1]
    for field in dataclasses.fields(HostBatch):
        want, got = getattr(host, field.name), getattr(back.host, field.name)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) and got.dtype == want.dtype
        elif field.name == "other_groups":
            assert all(torch.equal(a, b) for pair_a, pair_b in zip(got, want) for a, b in zip(pair_a, pair_b))
        elif field.name in ("pooled_sources", "pooled_starts"):
            assert got.keys() == want.keys() and all(torch.equal(got[g], want[g]) for g in want)
        else:
            assert got == want
