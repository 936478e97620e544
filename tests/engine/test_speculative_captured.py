"""Speculative decoding through the captured-step path (runner/verify_graphs.py) on CPU: decode and verify steps
staged into static buffers and run on a captured step's metadata (tests/runner/static_steps.py, all but the capture
itself), with MTP drafts (the graphs' hidden states before the final norm feed the draft layer) and prompt-lookup
drafts (draft counts differing within a step). Greedy tokens equal the plain engine's and the blocks come back."""

from __future__ import annotations

import pytest

from mlaserve import LLM
from tests.engine.test_speculative import NGRAM
from tests.engine.test_speculative import prompts as ngram_prompts
from tests.engine.test_speculative_mtp import BASE, GREEDY, mtp, prompts, tokens
from tests.runner.static_steps import StaticStepsOnCPU

MAX_LEN = 128


class Recorded(StaticStepsOnCPU):
    """Notes each step's draft counts (one per request, in batch order)."""

    def __init__(self, runner, max_model_len: int = MAX_LEN) -> None:
        super().__init__(runner, max_model_len)
        self.draft_counts: list[list[int]] = []

    def _forward(self, batch, source=None, shift=None):
        self.draft_counts.append([len(s.spec_token_ids) for s in batch.order])
        return super()._forward(batch, source, shift)


def captured(path, batch, params, **options) -> tuple[list, LLM, Recorded]:
    llm = LLM(str(path), **{**BASE, "max_model_len": MAX_LEN, **options})
    static = llm.engine.runner.graphs = Recorded(llm.engine.runner)
    return llm.generate(batch, params, use_tqdm=False), llm, static


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_through_captured_steps_equals_the_plain_engine(mtp_models, echo: bool, k: int) -> None:
    path, want = mtp_models[echo]
    outs, llm, static = captured(path, prompts(), GREEDY, speculative_config=mtp(k))
    assert tokens(outs) == want
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    if echo:  # a hidden state from the wrong row would show as a rejected draft
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    verify = [counts for counts in static.draft_counts if any(counts)]
    assert verify and any(max(counts) == k for counts in verify)


def test_ngram_through_captured_steps_equals_the_plain_engine(deepseek) -> None:
    batch = ngram_prompts()
    want = tokens(LLM(str(deepseek), **BASE).generate(batch, GREEDY, use_tqdm=False))
    outs, llm, static = captured(deepseek, batch, GREEDY, speculative_config=NGRAM)
    assert tokens(outs) == want
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"] and stats["kv_blocks_used"] == 0
    # Steps whose requests carry different draft counts (none, some, k) ran on the captured path too.
    assert any(len(set(counts)) > 1 for counts in static.draft_counts)
    assert any(max(counts) == 3 for counts in static.draft_counts)


def test_steps_past_the_largest_size_or_with_prompts_run_eagerly(deepseek) -> None:
    """Six requests with three drafts each need 24 rows; with sizes up to 8 such steps, and every step that carries
    a prompt chunk, run eagerly, and the tokens stay the plain engine's."""
    batch = ngram_prompts()
    want = tokens(LLM(str(deepseek), **BASE).generate(batch, GREEDY, use_tqdm=False))
    llm = LLM(str(deepseek), **{**BASE, "max_model_len": MAX_LEN}, speculative_config=NGRAM,
              max_num_batched_tokens=16, enable_chunked_prefill=True)  # fmt: skip
    static = llm.engine.runner.graphs = StaticStepsOnCPU(llm.engine.runner, MAX_LEN, sizes=(1, 2, 4, 8))
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == want
    assert static.rows and max(static.rows) <= 8 and llm.stats()["kv_blocks_used"] == 0


SHORT = dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=64)


def test_mtp_echo_under_chunking_preemption_and_hits(mtp_models) -> None:
    """Prompt chunks (eager) and decode and verify steps (captured) both feed the draft layer's rows; recomputed
    requests and prefix hits too: a row from the wrong step or position would show as a rejected draft."""
    path, want = mtp_models[True]
    llm = LLM(str(path), **{**BASE, **SHORT}, speculative_config=mtp(2))
    static = llm.engine.runner.graphs = Recorded(llm.engine.runner, SHORT["max_model_len"])
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == tokens(again) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert any(max(counts) == 2 for counts in static.draft_counts)


@pytest.mark.slow  # the interpreter: a minute or two on CPU
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_on_the_triton_decode_kernel(mtp_models, deepseek, method: str) -> None:
    """The triton_mla backend (the CPU interpreter here), whose decode kernel is what the GPU's graphs replay: each
    verify row reads its request's table up to its own length, from a step's static inputs."""
    pytest.importorskip("triton")
    # the echo layer (drafts hold), and the plain model on prompts that repeat (prompt-lookup drafts found)
    path, spec = (mtp_models[True][0], mtp(2)) if method == "mtp" else (deepseek, NGRAM)
    batch = ngram_prompts()[:4]
    options = {**BASE, "max_model_len": MAX_LEN, "attention_backend": "triton_mla"}
    want = tokens(LLM(str(path), **options).generate(batch, GREEDY, use_tqdm=False))
    llm = LLM(str(path), **options, speculative_config=spec)
    static = llm.engine.runner.graphs = Recorded(llm.engine.runner)
    assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert any(max(counts) == spec["num_speculative_tokens"] for counts in static.draft_counts)
