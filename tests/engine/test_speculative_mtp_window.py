"""DeepSeek MTP drafts under the training-free sliding window (with mla_disable: the window takes per-head K/V
caches): the draft layer attends by its cache group's rule, as the target's layers do, never over blocks the window
gave back. Greedy tokens equal the plain windowed engine's, and every drafts list equals the reference's, which
masks the main model's and the layer's attention to the same window."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.spec_decode.model_drafts import ModelDrafts
from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.mtp_reference import MtpReference
from tests.engine.test_speculative_mtp import mtp, prompts, tokens

WINDOW, SINKS = 8, 4
BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, mla_disable=True)
WINDOWED = dict(BASE, sliding_window=WINDOW, num_sink_tokens=SINKS)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# A 12-token step chunks the prompts and caps the drafts; the window bounds each table, so only a pool this small
# preempts. With the default pool a second run starts from the prefix cache's blocks.
PREEMPTED = dict(max_num_batched_tokens=12, num_kv_blocks=11, max_model_len=64)
HITS = dict(max_num_batched_tokens=12, max_model_len=64)


@pytest.fixture(scope="module")
def with_mtp(deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A random MTP layer and the plain windowed engine's tokens."""
    path = add_mtp_layer(deepseek, tmp_path_factory.mktemp("v3_mtp_window"))
    return path, tokens(LLM(str(path), **WINDOWED).generate(prompts(), GREEDY, use_tqdm=False))


def record_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """Every (known tokens, drafts) the scheduler is offered from here on."""
    seen: list[tuple[list[int], list[int]]] = []
    take = ModelDrafts.drafts_for

    def record(self: ModelDrafts, request: object, max_tokens: int) -> list[int]:
        if request.drafts_at == request.num_tokens:
            seen.append((list(request.all_token_ids), list(request.draft_token_ids)))
        return take(self, request, max_tokens)

    monkeypatch.setattr(ModelDrafts, "drafts_for", record)
    return seen


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    "options", [{}, PREEMPTED, HITS], ids=["batched", "chunked_preempted", "prefix_hits"]
)
def test_greedy_tokens_equal_the_plain_windowed_engines(with_mtp, k: int, options: dict) -> None:
    path, want = with_mtp
    llm = LLM(str(path), **{**WINDOWED, **options}, speculative_config=mtp(k))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    if options is PREEMPTED:
        assert llm.stats()["num_preemptions"] > 0
    if options is HITS:
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        assert llm.stats()["prefix_cache_hits"] > 0
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert stats["kv_cache_groups"][0].startswith(f"window {WINDOW} + {SINKS} sink tokens")


@pytest.mark.parametrize("options", [{}, HITS], ids=["batched", "prefix_hits"])
def test_drafts_equal_the_windowed_reference(with_mtp, monkeypatch, options: dict) -> None:
    """The drafts are the windowed reference's, and over sequences past the window they are not all what the
    layer would draft attending over everything (so the window's rule is the one being checked)."""
    path, _ = with_mtp
    seen = record_drafts(monkeypatch)
    llm = LLM(str(path), **{**WINDOWED, **options}, speculative_config=mtp(3))
    llm.generate(prompts(), GREEDY, use_tqdm=False)
    if options:
        llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] > 0
    windowed = MtpReference(path, WINDOW, SINKS)
    full = MtpReference(path)
    assert len(seen) > 4 and any(len(drafts) == 3 for _, drafts in seen)
    differ = 0
    for known, drafts in seen:
        assert drafts == windowed.drafts(known, len(drafts)), known
        differ += drafts != full.drafts(known, len(drafts))
    assert differ > 0


@pytest.mark.parametrize("k", [1, 2])
def test_the_captured_pass_drafts_as_the_eager_one(with_mtp, monkeypatch, k: int) -> None:
    """Decode and verify steps staged as the graphs stage them (their metadata carries the group's window), the
    draft pass on their static inputs: each pass's drafts equal the eager drafter's on the same step."""
    from tests.engine.test_mtp_draft_graphs import captured

    path, want = with_mtp
    llm, graphs = captured(path, monkeypatch, **WINDOWED, speculative_config=mtp(k))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    assert len(graphs.compared) >= 4 and llm.stats()["kv_blocks_used"] == 0


def test_compress_ratio_turns_mtp_off(with_mtp, caplog) -> None:
    """The draft layer's pass does not pool its own rows into compress_ratio's entries: speculation is off, logged,
    and the tokens are the plain engine's."""
    path, _ = with_mtp
    pooled = dict(WINDOWED, compress_ratio=4)
    want = tokens(LLM(str(path), **pooled).generate(prompts(), GREEDY, use_tqdm=False))
    with caplog.at_level("WARNING"):
        llm = LLM(str(path), **pooled, speculative_config=mtp(2))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    assert not llm.stats()["speculative_decoding"] and "compress_ratio" in caplog.text
