"""DeepSeek MTP speculative decoding: greedy requests keep exactly the plain engine's tokens (batched, chunked,
preempted, with prefix hits), the engine's drafts are the plain reference's, a constructed case accepts drafts,
and a checkpoint or model without the layer is refused with a message that says why."""

from __future__ import annotations

import json

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.spec_decode.model_drafts import ModelDrafts
from mlaserve.testing.mtp_checkpoint import add_mtp_layer
from mlaserve.testing.tiny_models import build_tiny

BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 17, 30, 9)) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in lengths]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate(path, batch, params, **options) -> tuple[list, LLM]:
    llm = LLM(str(path), **{**BASE, **options})
    return llm.generate(batch, params, use_tqdm=False), llm


@pytest.fixture(scope="module")
def plain_v3(tmp_path_factory):
    return build_tiny("deepseek_v3", tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def with_mtp(plain_v3, tmp_path_factory):
    """A random MTP layer: drafts mostly rejected, every path run."""
    path = add_mtp_layer(plain_v3, tmp_path_factory.mktemp("v3_mtp"))
    return path, tokens(generate(path, prompts(), GREEDY)[0])


@pytest.fixture(scope="module")
def echo(plain_v3, tmp_path_factory):
    """The MTP layer predicts what the main model says next (mtp_checkpoint.py's echo case)."""
    path = add_mtp_layer(plain_v3, tmp_path_factory.mktemp("v3_echo"), echo=True)
    return path, tokens(generate(path, prompts(), GREEDY)[0])


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_equal_the_plain_engines(with_mtp, k: int) -> None:
    path, want = with_mtp
    outs, llm = generate(path, prompts(), GREEDY, speculative_config=mtp(k))
    assert tokens(outs) == want
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["kv_blocks_used"] == 0
    assert stats["num_draft_tokens"] > 0 and len(stats["num_accepted_tokens_per_pos"]) == k
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drafts_that_hold_are_accepted(echo, k: int) -> None:
    path, want = echo
    outs, llm = generate(path, prompts(), GREEDY, speculative_config=mtp(k))
    assert tokens(outs) == want
    stats = llm.stats()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    per_pos = stats["num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and all(n > 0 for n in per_pos)
    assert stats["num_generated_tokens"] == sum(len(t) for t in want) and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("k", [1, 2])
def test_chunked_preempted_and_prefix_hits(with_mtp, k: int) -> None:
    """A 12-token step chunks the prompts and caps the drafts; 20 blocks of 4 tokens hold fewer tokens than the
    4 requests need, so requests are preempted and recomputed; the second run hits the prompts' cached blocks."""
    path, want = with_mtp
    options = dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=64, speculative_config=mtp(k))
    outs, llm = generate(path, prompts(), GREEDY, **options)
    assert tokens(outs) == want
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(again) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_echo_case_accepts_under_chunking_preemption_and_hits(echo) -> None:
    """Drafts keep holding when the layer's rows come from chunks, recomputation and prefix hits: a row made
    with the wrong token or hidden state would show as a rejected draft."""
    path, want = echo
    options = dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=64, speculative_config=mtp(2))
    outs, llm = generate(path, prompts(), GREEDY, **options)
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == tokens(again) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0


def test_sampled_requests_run_with_drafts(echo) -> None:
    """Rejection sampling is the n-gram method's: a point-mass draft. Seeded requests repeat themselves; in the
    echo case the target distribution is near a point mass, so drafts are still accepted."""
    path, _ = echo
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    first, llm = generate(path, prompts(), params, speculative_config=mtp(2))
    second = llm.generate(prompts(), params, use_tqdm=False)
    assert tokens(first) == tokens(second)
    assert all(len(t) == 16 for t in tokens(first))
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def reference(with_mtp):
    from mlaserve.testing.mtp_reference import MtpReference

    return MtpReference(with_mtp[0])


SHORT = dict(max_num_batched_tokens=12, num_kv_blocks=20, max_model_len=64)


@pytest.mark.parametrize("options", [{}, SHORT], ids=["batched", "chunked_preempted_hits"])
def test_drafts_equal_the_plain_reference(with_mtp, reference, monkeypatch, options: dict) -> None:
    """Every drafts list the scheduler takes equals transformers' MTP layer run on the whole sequence: the
    layer's cached rows are right after chunked prompts, recomputation and prefix hits (a second run)."""
    path, _ = with_mtp
    seen: list[tuple[list[int], list[int]]] = []
    take = ModelDrafts.drafts_for

    def record(self, request, max_tokens):
        if request.drafts_at == request.num_tokens:
            seen.append((list(request.all_token_ids), list(request.draft_token_ids)))
        return take(self, request, max_tokens)

    monkeypatch.setattr(ModelDrafts, "drafts_for", record)
    batch = prompts() if options else prompts(lengths=(5, 17))
    params = GREEDY if options else SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, llm = generate(path, batch, params, speculative_config=mtp(3), **options)
    if options:
        llm.generate(batch, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert len(seen) > 4
    for known, drafts in seen:
        assert drafts == reference.drafts(known, len(drafts)), known
    assert any(len(drafts) == 3 for _, drafts in seen)


def test_refused_without_the_layer(plain_v3, tmp_path) -> None:
    """transformers' DeepseekV3Config declares one MTP layer by default: the tiny checkpoint declares it without
    its weights; with num_nextn_predict_layers 0 it declares none."""
    with pytest.raises(ValueError, match=r"lacks \d+ of its layer's weights \(model\.layers\.2\.\*"):
        LLM(str(plain_v3), **BASE, speculative_config=mtp(1))
    none = tmp_path / "none"
    none.mkdir()
    for path in plain_v3.iterdir():
        (none / path.name).write_bytes(path.read_bytes())
    config = json.loads((plain_v3 / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(str(none), **BASE, speculative_config=mtp(1))


def test_refused_for_models_without_mtp(llama) -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(str(llama), **BASE, speculative_config=mtp(1))


@pytest.mark.parametrize("variant", ["deepseek_v32", "block_fp8"])
def test_v32_and_block_fp8_checkpoints(plain_v3, tmp_path, variant: str) -> None:
    """DeepSeek-V3.2 (its MTP layer has an indexer too) and DeepSeek's block-FP8 layout (the MTP layer's
    projections and experts in FP8 with their scales): tokens exact with a random layer, drafts held in the echo
    case."""
    from mlaserve.testing.fp8_checkpoint import save_block_fp8

    source = build_tiny("deepseek_v32", tmp_path / "src") if variant == "deepseek_v32" else plain_v3
    batch = prompts(lengths=(5, 30))
    for echo in (False, True):
        path = add_mtp_layer(source, tmp_path / f"mtp_{echo}", echo=echo)
        if variant == "block_fp8":
            path = save_block_fp8(path, tmp_path / f"fp8_{echo}")
        want = tokens(generate(path, batch, GREEDY)[0])
        outs, llm = generate(path, batch, GREEDY, speculative_config=mtp(2))
        assert tokens(outs) == want, echo
        stats = llm.stats()
        assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
        if echo:
            assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
