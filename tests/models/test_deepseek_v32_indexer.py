"""DeepSeek-V3.2 (lightning indexer + sparse MLA) against transformers' DeepseekV32ForCausalLM, with prompts and
outputs longer than index_topk so the sparse path really runs: chunked prefill, prefix-cache hits, preemption and
batching must all give transformers' greedy tokens, and our logprobs its teacher-forced log-softmax within 1e-4.

The tiny model has 16 indexer heads: with few heads, index scores of exactly 0 (every head's ReLU at 0) are
common, and such ties in the top-k make transformers' own cached and uncached paths disagree."""

import json

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import (
    check_against_reference,
    check_prefix_hits_against_reference,
    prompts,
)

OPTIONS = dict(dtype="float32", device="cpu")
TOPK = 8


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return build_tiny("deepseek_v32", tmp_path_factory.mktemp("v32"), index_topk=TOPK)


@pytest.fixture
def selections(monkeypatch):
    """Counts the steps in which the indexer selected tokens (rather than leaving a short context dense)."""
    import mlaserve.attention.sparse as sparse

    calls, real = [], sparse.select_topk
    monkeypatch.setattr(sparse, "select_topk", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
        dict(
            block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_model_len=128
        ),  # tight: requests are preempted
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_sparse_attention_equals_transformers(v32, options, selections):
    llm = LLM(str(v32), **{**OPTIONS, "num_kv_blocks": 256, **options})
    batch = prompts(4, seed=1, low=10, high=60)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(v32, batch, outs)
    assert selections, "no step ran the sparse path"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_keep_sparse_outputs(v32, selections):
    check_prefix_hits_against_reference(v32, 40, **OPTIONS, num_kv_blocks=256)


def test_indexer_keys_share_the_latent_blocks_and_8bit_caches_quantize_them(v32):
    llm = LLM(str(v32), **OPTIONS, num_kv_blocks=64, kv_cache_dtype="fp8_e4m3")
    latent, keys = llm.engine.executor.kv_caches[0]
    assert latent.shape[:2] == keys.shape[:2]  # one block id addresses both
    assert keys.dtype == torch.float8_e4m3fn and keys.shape[-1] == 32 + 16  # values, then the row's scale
    cfg = json.loads((v32 / "config.json").read_text())
    per_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + 16) + (cfg["index_head_dim"] + 16)
    assert llm.engine.executor.kv_cache.bytes_per_token == 2 * per_layer
    index = 2 * (cfg["index_head_dim"] + 16)
    assert llm.stats()["kv_cache_groups"] == [
        f"full: 2 layers, {2 * per_layer} bytes/token ({index} of them indexer keys)"
    ]
    out = llm.generate(
        [{"prompt_token_ids": prompts(1, seed=4, low=30, high=31)[0]}],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 20 and llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"index_topk": 0}, "index_topk must be a positive integer"),
        ({"index_n_heads": -1}, "index_n_heads must be a positive integer"),
        ({"index_head_dim": 8}, "qk_rope_head_dim=16 of its index_head_dim=8"),
        ({"q_lora_rank": None}, "q_lora_rank"),
    ],
)
def test_an_indexer_that_does_not_fit_the_model_is_an_error_before_weights_load(
    v32, tmp_path, monkeypatch, change, message
):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((v32 / name).read_bytes())
    config = json.loads((v32 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    loaded = []
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu", num_kv_blocks=16, load_format="dummy")
    assert not loaded


def test_mla_disable_is_refused_for_sparse_attention(v32):
    with pytest.raises(ValueError, match="mla_disable is not supported with DeepSeek-V3.2"):
        LLM(str(v32), **OPTIONS, num_kv_blocks=16, mla_disable=True)


def test_transformers_without_a_v32_config_class_reads_it_as_v3(v32, monkeypatch):
    # The GPU image's transformers predates DeepseekV32Config: the V3 class keeps every field, indexer ones too.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=5, low=20, high=30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [
        o.outputs[0].token_ids for o in LLM(str(v32), **OPTIONS, num_kv_blocks=64).generate(batch, params)
    ]
    monkeypatch.delitem(CONFIG_MAPPING._mapping, "deepseek_v32")
    llm = LLM(str(v32), **OPTIONS, num_kv_blocks=64)
    assert type(llm.engine.model_config.hf_config).__name__ == "DeepseekV3Config"
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == want


@pytest.mark.slow
def test_triton_backend_selection_and_sparse_attention_equal_transformers(v32):
    # Under TRITON_INTERPRET=1 (tests/conftest.py): the Triton index-score kernel and the paged decode kernel over
    # the selected rows, as on the GPU.
    pytest.importorskip("triton")
    llm = LLM(str(v32), **OPTIONS, num_kv_blocks=128, attention_backend="triton_mla")
    assert llm.stats()["attention_kernel"].startswith(f"sparse top-{TOPK}: triton index scores")
    batch = prompts(2, seed=6, low=12, high=30)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(v32, batch, outs)


def test_an_indexer_added_to_a_v3_checkpoint_is_a_v32_checkpoint_transformers_reads_whole(
    tmp_path, selections
):
    # mlaserve/testing/v32_checkpoint.py: how the GPU tests get a V3.2 checkpoint without transformers' classes
    from transformers import AutoModelForCausalLM

    from mlaserve.testing.v32_checkpoint import add_indexer

    v3 = build_tiny("deepseek_v3", tmp_path / "v3")
    path = add_indexer(v3, tmp_path / "v32", topk=TOPK)
    _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = prompts(2, seed=7, low=20, high=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), **OPTIONS, num_kv_blocks=64)
    check_against_reference(path, batch, llm.generate([{"prompt_token_ids": p} for p in batch], params))
    assert selections
    with pytest.raises(ValueError, match="q_lora_rank"):
        add_indexer(build_tiny("deepseek_v2", tmp_path / "v2"), tmp_path / "bad", topk=TOPK)
