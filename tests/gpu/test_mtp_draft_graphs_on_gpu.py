"""On a GPU (skipped in CI): the MTP draft pass of captured steps replayed from its own graphs (runner/mtp_graphs.py).
float32 tiny DeepSeek-V3 with an MTP layer on the triton_mla backend, graphs on: greedy tokens with mtp (k = 1, 2)
equal the plain engine's, every collected pass's drafts equal the eager drafter's on the same step (the draft
layer's cache put back after the check), the pass ran from its graphs, and the blocks come back.

    TRITON_INTERPRET=0 python -m pytest tests/gpu/test_mtp_draft_graphs_on_gpu.py
"""

import bisect

import pytest
import torch

from mlaserve import LLM
from mlaserve.runner import model_runner
from mlaserve.runner.mtp_draft import draft_spans
from mlaserve.runner.mtp_graphs import MtpDraftGraphs, collect_drafts
from tests.engine.test_speculative_mtp import mtp, prompts
from tests.gpu.test_speculative_on_gpu import GREEDY, OPTIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def generate(path, monkeypatch, **options) -> tuple[list[list[int]], dict, list[int]]:
    """Greedy tokens, stats and, with an MTP drafter, the requests compared in each captured pass."""
    llm = LLM(str(path), **OPTIONS, **options)
    runner = llm.engine.runner
    compared: list[int] = []
    pending: list = []
    if runner.drafter is not None:
        assert runner.draft_graphs is not None and runner.draft_graphs.graphs
        real_launch, drafter, cache = MtpDraftGraphs.launch, runner.drafter, runner.kv_caches[-1]

        def launch(self, host, drafted, targets, sampled, num_valid, draft_ids=None):
            size = self.source.sizes[bisect.bisect_left(self.source.sizes, len(host.ids))]
            pending[:] = [host, self.source.step_rows(size)[3].clone()]
            return real_launch(self, host, drafted, targets, sampled, num_valid, draft_ids)

        def check(queued, token_ids, num_accepted):
            got = collect_drafts(queued, token_ids, num_accepted)
            host, prenorm = pending
            saved = cache.clone()
            want = drafter.propose(draft_spans(host, token_ids, num_accepted), prenorm)
            cache.copy_(saved)
            assert got == want
            compared.append(len(want))
            return got

        monkeypatch.setattr(MtpDraftGraphs, "launch", launch)
        monkeypatch.setattr(model_runner, "collect_drafts", check)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    stats = llm.stats()
    del llm, runner
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], stats, compared


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_captured_draft_pass_equals_the_eager_one(mtp_models, monkeypatch, echo: bool, k: int) -> None:
    want, _, _ = generate(mtp_models[echo], monkeypatch)
    got, stats, compared = generate(mtp_models[echo], monkeypatch, speculative_config=mtp(k))
    assert got == want
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert compared and max(compared) == len(prompts())
    if echo:
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
