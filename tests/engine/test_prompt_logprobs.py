"""SamplingParams(prompt_logprobs=k) equals transformers' log-softmax over the prompt, whatever the scheduling:
one prefill, chunked prefill, a prompt whose prefix is cached, and requests preempted and recomputed."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import load_reference

TOL = 1e-4


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 70, (n,), generator=gen).tolist()
    return [torch.randint(3, 250, (k,), generator=gen).tolist() for k in lengths]


def reference_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_reference(model_dir)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(out, ids: list[int], ref: torch.Tensor, k: int) -> None:
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert next(iter(entry)) == ids[i]  # the prompt's own token first, as vLLM orders it
        value = ref[i - 1, ids[i]].item()
        assert abs(entry[ids[i]].logprob - value) < TOL, i
        # rank: the tokens at least as likely, itself included (allowing for the reference's rounding)
        rank = entry[ids[i]].rank
        assert int((ref[i - 1] > value + TOL).sum()) + 1 <= rank <= int((ref[i - 1] >= value - TOL).sum()), i
        top = ref[i - 1].topk(k)
        for position, (token, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert abs(entry[token].logprob - value) < TOL
            assert entry[token].rank == position or token == ids[i]
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("model", ["deepseek", "llama"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_transformers(model, chunk, request):
    path = request.getfixturevalue(model)
    options = dict(dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=128)
    if chunk:
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    llm = LLM(str(path), **options)
    batch = prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        check(out, ids, reference_logprobs(path, ids), 2)
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_cached_prefix_does_not_skip_the_logprobs_asked_for(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=128)
    ids = prompts(1, seed=2)[0]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)  # caches the prompt's full blocks
    hits = llm.stats()["prefix_cache_hits"]
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert out.num_cached_tokens == 0 and llm.stats()["prefix_cache_hits"] == hits
    check(out, ids, reference_logprobs(llama, ids), 0)
    # ... and it still writes its blocks for others: a plain request after it hits the cache.
    again = llm.generate([{"prompt_token_ids": ids}], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16


def test_preempted_requests_report_each_prompt_position_once(deepseek):
    batch = prompts(8, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    small = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=128)
    outs = small.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    for ids, out in zip(batch, outs):
        check(out, ids, reference_logprobs(deepseek, ids), 1)


def test_prompt_logprobs_are_none_unless_asked(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_a_one_token_prompt_has_only_the_leading_none(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)
    out = llm.generate(
        [{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False
    )
    assert out[0].prompt_logprobs == [None]
