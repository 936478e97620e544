"""Sliding-window attention (Mistral, Qwen2 with max_window_layers) against transformers, and the window group's
blocks going back to the pool as they leave the window, so a long generation holds a flat number of blocks."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny, load_reference

OPTIONS = dict(dtype="float32", device="cpu")


def prompts(n: int, seed: int, low: int = 20, high: int = 90) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(3, 250, (k,), generator=gen).tolist() for k in lengths]


def reference_tokens(path, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = load_reference(path).generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


def check_against_reference(path, batch: list[list[int]], outs) -> None:
    """Each output's greedy tokens are transformers' (as many as it generated) and its logprobs within 1e-4."""
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == reference_tokens(path, ids, len(out.outputs[0].token_ids))
        check_logprobs(path, ids, out)


def check_prefix_hits_against_reference(path, shared_len: int, **options) -> None:
    """Three prompts sharing a prefix of shared_len tokens, after a first request cached it: the prefix cache hits,
    and the outputs are still transformers' tokens and logprobs."""
    shared = prompts(1, seed=2, low=shared_len, high=shared_len + 1)[0]
    batch = [shared + p for p in prompts(3, seed=3, low=3, high=12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), **options)
    llm.generate([{"prompt_token_ids": batch[0]}], params, use_tqdm=False)  # caches the shared prefix
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > 0
    check_against_reference(path, batch, outs)


def check_logprobs(path, ids: list[int], out) -> None:
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = load_reference(path)(torch.tensor([ids + tokens])).logits[0].float().log_softmax(-1)
    for i, (entry, token) in enumerate(zip(out.outputs[0].logprobs, tokens)):
        assert abs(entry[token].logprob - ref[len(ids) - 1 + i, token].item()) < 1e-4, i


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build_tiny(
        "mistral", tmp_path_factory.mktemp("swa_mistral"), sliding_window=24, max_position_embeddings=4096
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_tiny(
        "qwen2",
        tmp_path_factory.mktemp("swa_qwen2"),
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=2,
        max_position_embeddings=4096,
    )


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("model", ["mistral", "qwen2"])
def test_windowed_models_equal_transformers(model, chunk, request):
    path = request.getfixturevalue(model)
    options = dict(OPTIONS, num_kv_blocks=200, block_size=8, max_model_len=512)
    if chunk:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    llm = LLM(str(path), **options)
    groups = llm.stats()["kv_cache_groups"]
    assert groups == (["window 24: 2 layers, 512 bytes/token"] if model == "mistral" else [
        "full: 2 layers, 512 bytes/token", "window 24: 2 layers, 512 bytes/token"])  # fmt: skip
    batch = prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        assert out.outputs[0].token_ids == reference_tokens(path, ids, 40)
        check_logprobs(path, ids, out)
    assert llm.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hits_and_preemption_keep_windowed_outputs(mistral):
    batch = prompts(6, seed=2, low=40, high=70)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(str(mistral), **OPTIONS, num_kv_blocks=300, block_size=8, max_model_len=256)
    want = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in batch], params)]
    # The same prompts again: the window group's blocks hit the prefix cache.
    again = roomy.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert roomy.stats()["prefix_cache_hits"] > 0
    # 12 blocks, 16-token steps: a request holds at most ceil((24 - 1 + 16) / 8) + 1 = 6, so two run at a time.
    tight = LLM(
        str(mistral), **OPTIONS, num_kv_blocks=13, block_size=8, max_model_len=256, max_num_batched_tokens=16
    )
    got = tight.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert tight.stats()["num_preemptions"] > 0 and tight.stats()["kv_blocks_used"] == 0


def test_a_long_generation_holds_a_flat_number_of_window_blocks(tmp_path):
    path = build_tiny("mistral", tmp_path, sliding_window=64, max_position_embeddings=8192)
    llm = LLM(
        str(path), **OPTIONS, block_size=16, num_kv_blocks=32, max_model_len=4200, max_num_batched_tokens=128
    )
    engine = llm.engine
    ids = prompts(1, seed=3, low=100, high=101)[0]
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    rid = engine.add_request({"prompt_token_ids": ids}, params)
    most, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step(stream=False):
            if o.request_id == rid:
                out = o
        most = max(most, engine.stats()["kv_blocks_by_group"][0])
    assert len(out.outputs[0].token_ids) == 4096
    assert most <= -(-64 // 16) + 1, most  # ceil(64 / 16) + 1: the window, and the block being filled
    assert out.outputs[0].token_ids[:256] == reference_tokens(path, ids, 256)


def test_a_windowed_model_serves_past_its_window(mistral):
    # max_model_len is no longer capped at the window: the model's max_position_embeddings is the limit.
    llm = LLM(str(mistral), **OPTIONS, num_kv_blocks=64, max_num_batched_tokens=64)
    assert llm.engine.model_config.max_model_len == 4096
