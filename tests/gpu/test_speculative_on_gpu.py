"""On a GPU (skipped in CI): speculative decoding with CUDA graphs on, where verify steps replay the decode graphs
one row per token (runner/verify_graphs.py) and an MTP engine's graphs keep the hidden states its draft layer reads.
float32 tiny DeepSeek-V3 with an MTP layer on the triton_mla backend: greedy tokens with `mtp` (k = 1, 2) and
`ngram` (k = 3) equal the plain engine's with graphs, verify steps did run from the graphs, and the blocks come
back. The echo layer (drafts that hold) shows the graphs' hidden states are the right rows'.

    TRITON_INTERPRET=0 python -m pytest tests/gpu/test_speculative_on_gpu.py
"""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.runner import model_runner
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as ngram_prompts
from tests.engine.test_speculative_mtp import mtp, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OPTIONS = dict(dtype="float32", device="cuda", attention_backend="triton_mla", num_kv_blocks=64, block_size=64,
               max_model_len=256, max_num_seqs=8)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(path, batch: list[dict], monkeypatch, **options) -> tuple[list[list[int]], dict, list[bool]]:
    """Greedy tokens, stats and, per verify step (a step with drafts), whether it ran from the graphs."""
    verify_steps: list[bool] = []
    real = model_runner.run_captured

    def noted(graphs, batch, source, verify_rows, keep_prenorm, shift=None):
        out = real(graphs, batch, source, verify_rows, keep_prenorm, shift)
        if verify_rows:
            verify_steps.append(out is not None)
        return out

    monkeypatch.setattr(model_runner, "run_captured", noted)
    llm = LLM(str(path), **OPTIONS, **options)
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    stats = llm.stats()
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], stats, verify_steps


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_with_graphs_equals_the_plain_engine(mtp_models, monkeypatch, echo: bool, k: int) -> None:
    want, _, _ = run(mtp_models[echo], prompts(), monkeypatch)
    got, stats, verify_steps = run(mtp_models[echo], prompts(), monkeypatch, speculative_config=mtp(k))
    assert got == want
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert verify_steps and all(verify_steps)  # every decode step of 4 requests fits the graphs
    if echo:
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]


def test_ngram_with_graphs_equals_the_plain_engine(mtp_models, monkeypatch) -> None:
    batch = ngram_prompts()
    want, _, _ = run(mtp_models[False], batch, monkeypatch)
    got, stats, verify_steps = run(mtp_models[False], batch, monkeypatch, speculative_config=NGRAM)
    assert got == want
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"] and stats["kv_blocks_used"] == 0
    assert verify_steps and any(verify_steps)  # a step beside a prompt chunk runs eagerly
