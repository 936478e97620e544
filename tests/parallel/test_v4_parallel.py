"""DeepSeek-V4 over two ranks on CPU (gloo): query heads split as whole output groups, experts split by width
(tensor parallel) or whole (expert parallel, hash-routed layers too), every rank caching the same shared kv rows;
the same greedy tokens as one process and logprobs within 1e-4 in float32, with chunked prefill and prefix-cache
hits, on an 8-bit cache, and in V4-Flash's published layout (MXFP4 experts split by width or whole)."""

from __future__ import annotations

import json
import shutil

import pytest

from mlaserve import LLM
from tests.parallel.test_tensor_parallel import PARAMS, assert_same, prompts

pytestmark = pytest.mark.slow
# blocks of 4: a prefix hit ends on a boundary of every group, 4 x the largest rate (8) tokens
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=48, block_size=4)


def run(model, **options: object) -> tuple[list, dict]:
    llm = LLM(str(model), **OPTIONS, num_kv_blocks=128, **options)
    try:
        layer = llm.engine.executor.model.model.layers[0]  # rank 0's
        experts = layer.ffn.experts
        split = {
            "heads": layer.attn.num_heads,
            "experts": len(layer.ffn.local),
            "width": getattr(experts, "inter", 0),
        }
        return llm.generate(prompts(), PARAMS, use_tqdm=False), {**llm.stats(), **split}
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    "options",
    [{}, {"enable_expert_parallel": True}, {"kv_cache_dtype": "fp8_e4m3"}],
    ids=["tp2", "ep2", "tp2-fp8-cache"],
)
def test_v4_over_two_ranks_gives_one_process_tokens(tiny, options):
    model = tiny("deepseek_v4")
    got, stats = run(model, tensor_parallel_size=2, **options)
    assert stats["tensor_parallel_size"] == 2 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0
    # 4 heads and 8 experts (the first layer hash-routed): half the heads, every expert or half of them
    assert (stats["heads"], stats["experts"]) == (2, 4 if "enable_expert_parallel" in options else 8)
    want, _ = run(model, **{k: v for k, v in options.items() if k == "kv_cache_dtype"})
    assert_same(want, got)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """V4-Flash's published layout (block-FP8 projections, MXFP4 experts) at widths whose row-split inputs hold
    whole 128-column scale blocks per rank (wo_b's 2 x 128, the shared expert's 256)."""
    from mlaserve.testing.tiny_models import build_tiny
    from mlaserve.testing.v4_checkpoint import save_v4_published

    tmp = tmp_path_factory.mktemp("v4_published")
    src = build_tiny("deepseek_v4", tmp / "src", o_lora_rank=128, moe_intermediate_size=256)
    return save_v4_published(src, tmp / "published")


@pytest.mark.parametrize(
    "options", [{"enable_expert_parallel": True}, {}], ids=["ep2-whole-experts", "tp2-experts-by-width"]
)
def test_published_v4_over_two_ranks_gives_one_process_tokens(published, options):
    got, stats = run(published, tensor_parallel_size=2, **options)
    assert stats["quantization"] == "fp8" and stats["experts"] == (4 if options else 8)
    assert stats["width"] == (256 if options else 128)  # whole MXFP4 experts, or half of each one's width
    want, _ = run(published)
    assert_same(want, got)


def test_mxfp4_widths_that_cut_scale_groups_are_refused_before_loading(published, tmp_path):
    """moe_intermediate_size 96 over 2 ranks: 48 columns of w2 per rank, one and a half e8m0 scale groups."""
    folder = tmp_path / "v4_96"
    shutil.copytree(published, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(96\) split over 2 ranks gives 48 columns"):
        LLM(str(folder), **OPTIONS, tensor_parallel_size=2)
