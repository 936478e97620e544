"""DeepSeek-V4's MTP layer (models/deepseek_v4_mtp.py) as the "mtp" draft model on a tiny V4 (a window, entries
compressed 8:1 and 4:1, hash- and score-routed MoE): greedy tokens equal the plain engine's, batched, chunked,
preempted and from prefix hits; in the echo case every draft holds; checkpoints without the layer or with a
compressed one are refused, naming what is missing; its checkpoint names load where DeepSeek ships them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.models.deepseek_v4_mtp import mtp_param_name
from mlaserve.testing.tiny_models import build_tiny
from mlaserve.testing.v4_mtp_checkpoint import add_v4_mtp_layer

BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# A 12-token step chunks the prompts inside compression windows and caps the drafts; 13 blocks a pool preempt.
PREEMPTED = dict(max_num_batched_tokens=12, num_kv_blocks=13, max_model_len=128)
# Hits end on a block of every group (32 tokens: 4 x 8 for the 8:1 entries); the draft layer's stop one such step
# short, so only a prompt past 64 tokens hits.
HITS = dict(max_num_batched_tokens=12, max_model_len=128)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 17, 40, 9)) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in lengths]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("deepseek_v4", tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module", params=[False, True], ids=["random", "echo"])
def with_mtp(request: pytest.FixtureRequest, v4: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(echo, checkpoint, the plain engine's tokens)."""
    path = add_v4_mtp_layer(v4, tmp_path_factory.mktemp(f"v4_mtp_{request.param}"), echo=request.param)
    return request.param, path, tokens(LLM(str(path), **BASE).generate(prompts(), GREEDY, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_equal_the_plain_engines(with_mtp, k: int) -> None:
    echo, path, want = with_mtp
    llm = LLM(str(path), **BASE, speculative_config=mtp(k))
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
    stats = llm.stats()
    assert stats["speculative_decoding"] and stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    assert len(stats["num_accepted_tokens_per_pos"]) == k
    if echo:  # a row made from the wrong streams, token or cache rows would show as a rejected draft
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]


@pytest.mark.parametrize("options", [PREEMPTED, HITS], ids=["chunked_preempted", "prefix_hits"])
def test_chunked_preempted_and_prefix_hits(with_mtp, options: dict) -> None:
    echo, path, want = with_mtp
    batch = prompts() + prompts(1, (70,)) if options is HITS else prompts()
    if options is HITS:
        want = want + tokens(LLM(str(path), **BASE).generate(batch[-1:], GREEDY, use_tqdm=False))
    llm = LLM(str(path), **{**BASE, **options}, speculative_config=mtp(2))
    first = tokens(llm.generate(batch, GREEDY, use_tqdm=False))
    assert first == want
    stats = llm.stats()
    if options is PREEMPTED:
        assert stats["num_preemptions"] > 0
    else:  # the draft layer's hits stop a 32-token step short: the 70-token prompt hits 32
        assert tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == want
        assert llm.stats()["prefix_cache_hits"] >= 32
    assert llm.stats()["kv_blocks_used"] == 0
    if echo:
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0


def test_the_layer_adds_one_window_layer_and_no_entries(with_mtp) -> None:
    """Its block attends over the window alone: one more layer's rows in the window group, nothing pooled."""
    _, path, _ = with_mtp
    plain = LLM(str(path), **BASE).stats()
    drafting = LLM(str(path), **BASE, speculative_config=mtp(1)).stats()
    assert drafting["kv_cache_groups"][1:] == plain["kv_cache_groups"][1:]
    assert drafting["kv_bytes_per_token"] == plain["kv_bytes_per_token"]  # the window's rows do not grow
    assert drafting["kv_cache_groups"][0] != plain["kv_cache_groups"][0]


def test_refused_without_the_layers_weights(v4: Path) -> None:
    """transformers' V4 config declares one MTP layer by default; the tiny checkpoint has none of its weights."""
    with pytest.raises(ValueError, match=r"lacks \d+ of its layer's weights .*mtp\.0\.\* in DeepSeek-V4's"):
        LLM(str(v4), **BASE, speculative_config=mtp(1))


def test_refused_with_a_compressed_layer(with_mtp, tmp_path: Path) -> None:
    _, path, _ = with_mtp
    for source in path.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "compress_ratios": [0, 8, 4, 4]}))
    with pytest.raises(ValueError, match=r"compress_ratios\[3\]=4 gives DeepSeek-V4's MTP layer compressed"):
        LLM(str(tmp_path), **BASE, speculative_config=mtp(1))


@pytest.mark.parametrize(
    "name, want",
    [
        ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
        ("mtp.0.norm.weight", "mtp.0.norm.weight"),
        ("mtp.0.hc_head_fn", "mtp.0.hc_head.hc_fn"),
        ("mtp.0.attn.wq_a.scale", "mtp.0.block.attn.wq_a.scale"),
        ("mtp.0.hc_attn_fn", "mtp.0.block.hc_attn_fn"),
        ("mtp.0.ffn.experts.3.w1.weight", "mtp.0.block.ffn.experts.3.w1.weight"),
        ("mtp.0.attn_norm.weight", "mtp.0.block.attn_norm.weight"),
        ("mtp.0.block.attn.wkv.weight", "mtp.0.block.attn.wkv.weight"),  # the model's own names
        ("mtp.0.hc_head.hc_fn", "mtp.0.hc_head.hc_fn"),
        ("mtp.1.e_proj.weight", None),  # a second layer: not built
        ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.weight"),
    ],
)
def test_checkpoint_names(name: str, want: str | None) -> None:
    assert mtp_param_name(name, 1) == want
    assert mtp_param_name(name, 0) == (None if name.startswith("mtp.") else name)


@pytest.fixture(scope="module")
def random_layer(v4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_v4_mtp_layer(v4, tmp_path_factory.mktemp("v4_mtp_random"))


@pytest.mark.parametrize("options", [{}, PREEMPTED], ids=["batched", "chunked_preempted"])
def test_drafts_equal_the_reference(random_layer: Path, monkeypatch, options: dict) -> None:
    """Every drafts list the scheduler takes equals transformers' V4 running the layer's block on the whole
    sequence (testing/v4_mtp_reference.py): the streams it reads, its parts and the cached rows are right after
    chunked prompts and recomputation."""
    from mlaserve.spec_decode.model_drafts import ModelDrafts
    from mlaserve.testing.v4_mtp_reference import V4MtpReference

    path = random_layer  # the echo layer's block adds nothing: a random one checks it
    seen: list[tuple[list[int], list[int]]] = []
    take = ModelDrafts.drafts_for

    def record(self: ModelDrafts, request: object, max_tokens: int) -> list[int]:
        if request.drafts_at == request.num_tokens:
            seen.append((list(request.all_token_ids), list(request.draft_token_ids)))
        return take(self, request, max_tokens)

    monkeypatch.setattr(ModelDrafts, "drafts_for", record)
    batch = prompts(lengths=(5, 30)) if not options else prompts()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), **{**BASE, **options}, speculative_config=mtp(3))
    llm.generate(batch, params, use_tqdm=False)
    if options:
        assert llm.stats()["num_preemptions"] > 0
    reference = V4MtpReference(path)
    assert len(seen) > 4 and any(len(drafts) == 3 for _, drafts in seen)
    for known, drafts in seen:
        assert drafts == reference.drafts(known, len(drafts)), known


def test_published_layout(v4: Path, tmp_path: Path, monkeypatch) -> None:
    """The layer in V4-Flash's layout (its attention, shared expert, e_proj and h_proj in block FP8 with ue8m0
    scales, its routed experts in MXFP4): the echo layer's drafts all hold, and the random layer drafts exactly
    what it drafts on the same weights dequantized to float32."""
    from mlaserve.spec_decode.model_drafts import ModelDrafts
    from mlaserve.testing.v4_checkpoint import save_dequantized_v4, save_v4_published

    take = ModelDrafts.drafts_for

    def drafted(path: Path) -> tuple[list[tuple[list[int], list[int]]], dict]:
        seen: list[tuple[list[int], list[int]]] = []

        def record(self: ModelDrafts, request: object, max_tokens: int) -> list[int]:
            if request.drafts_at == request.num_tokens:
                seen.append((list(request.all_token_ids), list(request.draft_token_ids)))
            return take(self, request, max_tokens)

        monkeypatch.setattr(ModelDrafts, "drafts_for", record)
        llm = LLM(str(path), **BASE, speculative_config=mtp(2))
        llm.generate(prompts(lengths=(5, 30)), GREEDY, use_tqdm=False)
        return seen, llm.stats()

    for echo in (False, True):
        src = add_v4_mtp_layer(v4, tmp_path / f"src_{echo}", echo=echo)
        published = save_v4_published(src, tmp_path / f"published_{echo}")
        seen, stats = drafted(published)
        assert stats["num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
        if echo:
            assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
        else:
            reference = save_dequantized_v4(published, src, tmp_path / "dequantized")
            assert seen == drafted(reference)[0]
