"""Our engine against transformers' own classes on tiny random checkpoints, float32, greedy.

Tokens must be identical over 32 steps and our logprobs must equal transformers' log-softmax along the same
sequence (teacher forcing, one full forward) within 1e-4.
"""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import CONFIGS, build_tiny, load_reference

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


def prompts(seed: int = 1, lengths=(3, 17, 9, 40, 1, 25, 64, 6)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_reference(path)


def reference_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def reference_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(generated)[:, None])[:, 0]


def test_greedy_tokens_and_logprobs_match_transformers(tiny):
    name, path, hf = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batch = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        ours = out.outputs[0].token_ids
        assert ours == reference_greedy(hf, prompt), f"{name}: prompt of {len(prompt)} tokens"
        want = reference_logprobs(hf, prompt, ours)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ours)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert llm.stats()["kv_blocks_used"] == 0


def test_batched_equals_one_by_one_and_chunked_and_prefix_cached(tiny):
    name, path, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(seed=2)]

    def run(**opts) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=256, **opts)
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)], llm

    batched, _ = run()
    single = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=256)
    one_by_one = [single.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch]
    assert batched == one_by_one, name
    chunked, _ = run(max_num_batched_tokens=16)
    assert chunked == batched, name

    shared = prompts(seed=3, lengths=(40,))[0]
    with_prefix = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in batch]
    # Blocks of 4: a hit ends on a block of every cache group, and DeepSeek-V4's entry blocks span block_size x its
    # largest compression rate (32 tokens here, 128 with blocks of 16: longer than the shared prefix).
    small = dict(dtype="float32", device="cpu", num_kv_blocks=512, block_size=4)
    plain = LLM(str(path), **small, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(with_prefix, params, use_tqdm=False)]
    cached = LLM(str(path), **small)
    cached.generate(with_prefix[:1], params, use_tqdm=False)  # warms the cache with the shared prefix
    got = [o.outputs[0].token_ids for o in cached.generate(with_prefix, params, use_tqdm=False)]
    assert got == want, name
    assert cached.stats()["prefix_cache_hits"] > 0
