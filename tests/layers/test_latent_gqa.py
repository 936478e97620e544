"""enable_mla=True with no rank, the exact GQA/MHA -> MLA conversion (layers/latent_gqa.py): served from the
latent cache, tiny random Llama (GQA, MHA, tied llama3 rope), Qwen2 (qkv bias) and Mistral models give
transformers' greedy tokens and logprobs within 1e-4, batched, chunked and from prefix hits, with the original's
KV bytes per token; SmolLM2-135M gives its unconverted tokens."""

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import check_against_reference, prompts, reference_tokens

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=128)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama", {}),
        ("llama", dict(num_key_value_heads=4)),  # MHA
        ("llama_tied_llama3rope", {}),
        ("qwen2", {}),
        ("mistral", dict(sliding_window=256)),  # a window no request reaches (max_model_len 256)
    ],
    ids=["llama-gqa", "llama-mha", "llama3rope", "qwen2-bias", "mistral"],
)
def test_exact_conversion_equals_transformers(tmp_path, name, overrides):
    path = build_tiny(name, tmp_path, **overrides)
    llm = LLM(str(path), **OPTIONS, enable_mla=True, max_model_len=256)
    original = LLM(str(path), **OPTIONS, max_model_len=256)
    assert llm.engine.executor.kv_cache.spec.is_mla and not original.engine.executor.kv_cache.spec.is_mla
    assert llm.stats()["kv_bytes_per_token"] == original.stats()["kv_bytes_per_token"]
    batch = prompts(3, seed=1, low=10, high=60)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(path, batch, outs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_exact_conversion_with_chunks_prefix_hits_and_an_8bit_cache(tmp_path):
    path = build_tiny("llama", tmp_path)
    shared = prompts(1, seed=2, low=40, high=41)[0]
    batch = [shared + p for p in prompts(3, seed=3, low=3, high=12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [reference_tokens(path, ids, 16) for ids in batch]
    llm = LLM(str(path), **OPTIONS, enable_mla=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    llm.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    fp8 = LLM(
        str(path), **OPTIONS, enable_mla=True, kv_cache_dtype="fp8_e4m3"
    )  # per-head K/V models could not
    assert fp8.stats()["kv_bytes_per_token"] < llm.stats()["kv_bytes_per_token"]
    assert len(fp8.generate([{"prompt_token_ids": batch[0]}], params)[0].outputs[0].token_ids) == 16


@pytest.mark.slow
def test_smollm2_converted_gives_its_own_tokens():
    prompts_ = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=0)
    want = LLM(dtype="float32", device="cpu").generate(prompts_, params, use_tqdm=False)
    got = LLM(dtype="float32", device="cpu", enable_mla=True).generate(prompts_, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_enable_mla_is_refused_where_it_cannot_apply(tmp_path):
    mla = build_tiny("deepseek_v2", tmp_path / "v2")
    with pytest.raises(ValueError, match="enable_mla converts models with per-head K/V caches"):
        LLM(str(mla), device="cpu", enable_mla=True, load_format="dummy")
    windowed = build_tiny("mistral", tmp_path / "mistral", sliding_window=32)
    with pytest.raises(ValueError, match="enable_mla with sliding-window layers"):
        LLM(str(windowed), device="cpu", enable_mla=True, max_model_len=256)
