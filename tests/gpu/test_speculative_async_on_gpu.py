"""On a GPU (skipped in CI): speculative decoding with CUDA graphs on and asynchronous scheduling forced on. With MTP
the step after a verify step is queued before the verify step is read and replays the decode graphs, its rows
corrected on the device from the verify step's accepted counts and its input ids gathered there (the verify step's
next tokens and its captured draft pass's drafts; runner/queued_verify.py), its own draft pass queued after it; with
prompt lookup only prompt-chunk steps are followed by a queued step. float32 tiny DeepSeek-V3 with
an MTP layer on the triton_mla backend: greedy tokens with `mtp` (k = 1, 2) and `ngram` (k = 3) equal the plain
engine's with graphs, verify steps ran from the graphs, steps were queued ahead, and the blocks come back.

    TRITON_INTERPRET=0 python -m pytest tests/gpu/test_speculative_async_on_gpu.py
"""

import pytest
import torch

from mlaserve.runner import cuda_graphs
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as ngram_prompts
from tests.engine.test_speculative_async import LONG_FIRST, watch_lookaheads
from tests.engine.test_speculative_mtp import mtp, prompts
from tests.gpu.test_speculative_on_gpu import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# An 8-token step chunks the first prompt, so the steps behind its chunks are queued ahead.
ASYNC = dict(async_scheduling=True, max_num_batched_tokens=8)


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_with_graphs_and_async_equals_the_plain_engine(
    mtp_models, monkeypatch, echo: bool, k: int
) -> None:
    batch = [prompts()[i] for i in LONG_FIRST]
    want, _, _ = run(mtp_models[echo], batch, monkeypatch)
    seen = watch_lookaheads(monkeypatch)
    corrected = [0]  # replays corrected on the device from an unread verify step's accepted counts
    real = cuda_graphs.correct_rows

    def counted(*args):
        corrected[0] += 1
        return real(*args)

    monkeypatch.setattr(cuda_graphs, "correct_rows", counted)
    got, stats, verify_steps = run(mtp_models[echo], batch, monkeypatch, speculative_config=mtp(k), **ASYNC)
    assert got == want
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert verify_steps and any(verify_steps) and seen["pending"] > 0 and seen["queued_drafts"] > 0
    assert corrected[0] > 0  # steps queued behind unread verify steps replayed the graphs
    if echo:
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]


def test_ngram_with_graphs_and_async_equals_the_plain_engine(mtp_models, monkeypatch) -> None:
    batch = ngram_prompts()
    want, _, _ = run(mtp_models[False], batch, monkeypatch)
    seen = watch_lookaheads(monkeypatch)
    got, stats, verify_steps = run(mtp_models[False], batch, monkeypatch, speculative_config=NGRAM, **ASYNC)
    assert got == want
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"] and stats["kv_blocks_used"] == 0
    assert verify_steps and any(verify_steps) and seen["ahead"] > 0
