"""The engine's training-free index_topk (attention/block_topk.py): the block mask against a loop written from its
definition, exact attention when top-k covers every block, and the same tokens however the engine batches, chunks
or preempts (each query's selection depends on nothing else)."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.block_topk import block_mask
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import prompts


def mask_by_definition(q, k, q_pos, block_size, topk) -> torch.Tensor:
    hkv, n = k.shape[1], k.shape[0]
    groups = q.shape[1] // hkv
    out = torch.zeros(hkv, len(q_pos), n, dtype=torch.bool)
    for h in range(hkv):
        for t, pos in enumerate(q_pos.tolist()):
            own = pos // block_size
            keep = {0, own, own - 1}
            scores = {}
            for b in range(1, own - 1):
                mean = k[b * block_size : (b + 1) * block_size, h].mean(0)
                scores[b] = max(float(q[t, h * groups + g] @ mean) for g in range(groups))
            keep |= set(sorted(scores, key=scores.get, reverse=True)[:topk])
            for key in range(pos + 1):
                out[h, t, key] = key // block_size in keep
    return out


@pytest.mark.parametrize("topk", [1, 3, 50])
def test_block_mask_matches_its_definition(topk):
    gen = torch.Generator().manual_seed(topk)
    n, q_len, block = 70, 9, 8
    q = torch.randn(q_len, 6, 16, generator=gen)
    k = torch.randn(n, 2, 16, generator=gen)
    q_pos = torch.arange(n - q_len, n)
    assert torch.equal(block_mask(q, k, q_pos, block, topk), mask_by_definition(q, k, q_pos, block, topk))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))


def generate(path, **options) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=200, **options)
    batch = prompts(4, seed=3, low=30, high=70)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


def test_topk_over_every_block_is_exact_attention(llama):
    assert generate(llama, index_topk=1000) == generate(llama)


def test_selection_does_not_depend_on_batching_or_chunking(llama):
    sparse = generate(llama, index_topk=2)
    assert sparse != generate(llama)  # lossy: two blocks of 4 tokens leave most of a 90-token context out
    assert generate(llama, index_topk=2, enable_chunked_prefill=True, max_num_batched_tokens=11) == sparse
    assert generate(llama, index_topk=2, max_num_seqs=1) == sparse


def test_index_topk_is_refused_where_it_cannot_apply(llama, tmp_path):
    with pytest.raises(ValueError, match="index_topk=4: must be unset with sliding_window"):
        LLM(str(llama), device="cpu", index_topk=4, sliding_window=64)
    mla = build_tiny("deepseek_v2", tmp_path)
    with pytest.raises(ValueError, match="index_topk applies to models with per-head K/V caches"):
        LLM(str(mla), device="cpu", index_topk=4, load_format="dummy")
