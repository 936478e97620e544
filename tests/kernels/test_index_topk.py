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


def test_every_tile_down_the_ladder_scores_as_the_reference():
    """index_scores_paged on each tile its ladder may fall back to (kernels/fit.py), against the scores written out
    from their definition over the keys each token sees."""
    from mlaserve.kernels.index_topk import ScoreTile, index_scores_paged, score_tiles

    gen = torch.Generator().manual_seed(4)
    page, dim, heads = 16, 32, 5
    cache = torch.randn(12, page, 1, dim, generator=gen)
    tables = (torch.randperm(11, generator=gen)[:10] + 1).view(2, 5).int()
    rows, visible = torch.tensor([0, 0, 1]), torch.tensor([3, 50, 77])
    q = torch.randn(3, heads, dim, generator=gen)
    weights = torch.randn(3, heads, generator=gen)
    keys = cache.view(-1, dim)
    want = torch.full((3, 80), float("-inf"))
    for t in range(3):
        pos = torch.arange(int(visible[t]))
        slots = tables[rows[t], pos // page].long() * page + pos % page
        want[t, pos] = (torch.relu(0.3 * q[t] @ keys[slots].T) * weights[t, :, None]).sum(0)
    rungs = score_tiles(ScoreTile(64, 2, 4, 2), 16, dim, 4, 232_448)
    assert [(r.block_n, r.tiles, r.stages) for r in rungs] == [(64, 2, 2), (64, 2, 1), (32, 4, 1), (16, 8, 1)]
    for r in rungs:
        got = index_scores_paged(q, weights, cache, tables, rows, visible, 80, 0.3, *r)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=str(r))


@pytest.mark.parametrize("topk", [3, 64])
def test_selection_as_a_table_holds_the_same_slots_and_their_counts(topk):
    # The table form (DeepSeek-V4's decode): int32 slots, 0 after the picked ones, and their count per token.
    from mlaserve.kernels.index_topk import select_topk_paged

    cache, meta, _, gen = paged_batch(QUERY_LENS, SEQ_LENS, heads_kv=1, dim=16, seed=3)
    num_tokens = sum(QUERY_LENS)
    q = torch.randn(num_tokens, 8, 16, generator=gen)
    weights = torch.randn(num_tokens, 8, generator=gen)
    rows = torch.repeat_interleave(torch.arange(len(QUERY_LENS)), torch.tensor(QUERY_LENS))
    visible = (token_positions() + 1).to(torch.int32)
    args = (q, weights, cache, meta.block_tables, rows, visible, max(SEQ_LENS), topk, 0.25)
    want = select_topk_paged(*args)
    lens = torch.empty(num_tokens, dtype=torch.int32)
    got = select_topk_paged(*args, lens)
    assert got.dtype == torch.int32 and torch.equal(lens, (want >= 0).sum(1, dtype=torch.int32))
    assert torch.equal(got, want.clamp(min=0).to(torch.int32))
