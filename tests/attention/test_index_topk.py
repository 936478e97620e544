"""The Triton index-score + top-k kernel and the Triton sparse attention path against attention/sparse.py's torch
reference, under TRITON_INTERPRET=1 on CPU (tiny sizes)."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.sparse import select_topk, sparse_latent_attention  # noqa: E402
from mlaserve.attention.triton_mla import TritonMLABackend  # noqa: E402
from mlaserve.kvcache.quant import quantize_rows  # noqa: E402
from tests.attention.test_backends import paged_batch  # noqa: E402
from tests.attention.test_sparse import QUERY_LENS, SEQ_LENS  # noqa: E402


def token_positions() -> torch.Tensor:
    return torch.tensor([p for q, n in zip(QUERY_LENS, SEQ_LENS) for p in range(n - q, n)])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("topk", [3, 64])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, torch.int8])
def test_triton_selection_equals_the_reference(seed, topk, cache_dtype):
    cache, meta, _, gen = paged_batch(QUERY_LENS, SEQ_LENS, heads_kv=1, dim=16, seed=seed)
    if cache_dtype is not None:
        cache = quantize_rows(cache, cache_dtype)
    num_tokens = sum(QUERY_LENS)
    q = torch.randn(num_tokens, 8, 16, generator=gen)
    weights = torch.randn(num_tokens, 8, generator=gen)
    want = select_topk(q, weights, cache, meta, topk, 0.25)
    got = TritonMLABackend().select_topk(q, weights, cache, meta, token_positions(), topk, 0.25)
    assert got.shape == want.shape
    for t in range(num_tokens):  # the same set (unsorted: in any order), the -1s after the slots
        assert sorted(got[t].tolist()) == sorted(want[t].tolist()), t
        valid = (got[t] >= 0).tolist()
        assert valid == sorted(valid, reverse=True), t


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_triton_sparse_attention_equals_the_reference(cache_dtype):
    rank, rope, heads = 32, 16, 4
    cache, meta, _, gen = paged_batch(QUERY_LENS, SEQ_LENS, heads_kv=1, dim=rank + rope, seed=5)
    if cache_dtype is not None:
        cache = quantize_rows(cache, cache_dtype)
    num_tokens = sum(QUERY_LENS)
    q_latent = torch.randn(num_tokens, heads, rank, generator=gen)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen)
    weights = torch.randn(num_tokens, 8, generator=gen)
    index_q = torch.randn(num_tokens, 8, rank + rope, generator=gen)
    slots = select_topk(index_q, weights, cache, meta, 5, 0.1)  # any valid selection: -1s after the slots
    want = sparse_latent_attention(q_latent, q_pe, cache, slots, 0.3, rank)
    got = TritonMLABackend().sparse_latent(q_latent, q_pe, cache, slots, 0.3, rank)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
