"""Sparse MLA's torch reference (attention/sparse.py) against per-query loops on fresh random paged caches."""

import pytest
import torch

from mlaserve.attention.sparse import index_scores, select_topk, sparse_latent_attention
from mlaserve.kernels.mla_decode.reference import paged_latent_decode
from mlaserve.kvcache.quant import dequantize_rows, quantize_rows
from tests.attention.test_backends import BLOCK, paged_batch

QUERY_LENS, SEQ_LENS = (
    [1, 1, 1, 6, 9, 2],
    [3, 19, 12, 6, 21, 14],
)  # decodes, then prefills (some with context)


def query_slots(meta, seq_lens, query_lens) -> list[tuple[int, list[int]]]:
    """(sequence, the flat slots it may see) for each query token, in batch order."""
    table, out = meta.block_tables, []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        out += [(i, slots[: n - q + j + 1]) for j in range(q)]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("topk", [1, 5, 64])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_select_topk_picks_each_querys_best_visible_keys(seed, topk, cache_dtype):
    cache, meta, _, gen = paged_batch(QUERY_LENS, SEQ_LENS, heads_kv=1, dim=16, seed=seed)
    if cache_dtype is not None:
        cache = quantize_rows(cache, cache_dtype)
    keys = cache.flatten(0, 2)
    keys = dequantize_rows(keys, torch.float32) if cache_dtype is not None else keys
    num_tokens, heads = sum(QUERY_LENS), 8  # with few heads, exact-zero scores (every ReLU at 0) tie
    q = torch.randn(num_tokens, heads, 16, generator=gen)
    weights = torch.randn(num_tokens, heads, generator=gen)
    got = select_topk(q, weights, cache, meta, topk, 0.25)
    assert got.shape == (num_tokens, min(topk, max(SEQ_LENS)))
    for t, (_, visible) in enumerate(query_slots(meta, SEQ_LENS, QUERY_LENS)):
        scores = [
            sum(weights[t, h] * torch.relu(0.25 * q[t, h] @ keys[s]) for h in range(heads)) for s in visible
        ]
        order = sorted(range(len(visible)), key=lambda i: -float(scores[i]))
        if len(order) > topk:  # the test's inputs have no tie at the cut, so the set is well defined
            assert scores[order[topk - 1]] != scores[order[topk]]
        want = {visible[i] for i in order[:topk]}
        picked = got[t][got[t] >= 0].tolist()
        assert len(picked) == len(want) and set(picked) == want, f"query {t}"


def test_index_scores_shared_and_per_query_keys_agree():
    gen = torch.Generator().manual_seed(3)
    q, w, keys = (
        torch.randn(4, 2, 8, generator=gen),
        torch.randn(4, 2, generator=gen),
        torch.randn(7, 8, generator=gen),
    )
    shared = index_scores(q, w, keys, 0.5)
    torch.testing.assert_close(shared, index_scores(q, w, keys.expand(4, -1, -1), 0.5))
    want = (w[:, :, None] * torch.relu(0.5 * torch.einsum("nhd,ld->nhl", q, keys))).sum(1)
    torch.testing.assert_close(shared, want)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_sparse_attention_over_selected_rows_matches_masked_softmax(seed, cache_dtype):
    rank, rope, heads = 12, 4, 3
    cache, meta, _, gen = paged_batch(QUERY_LENS, SEQ_LENS, heads_kv=1, dim=rank + rope, seed=seed)
    if cache_dtype is not None:
        cache = quantize_rows(cache, cache_dtype)
    rows = cache.flatten(0, 2)
    rows = dequantize_rows(rows, torch.float32) if cache_dtype is not None else rows
    num_tokens = sum(QUERY_LENS)
    q_latent, q_pe = (
        torch.randn(num_tokens, heads, rank, generator=gen),
        torch.randn(num_tokens, heads, rope, generator=gen),
    )
    slots = torch.full((num_tokens, 6), -1, dtype=torch.long)
    for t, (_, visible) in enumerate(query_slots(meta, SEQ_LENS, QUERY_LENS)):
        pick = torch.randperm(len(visible), generator=gen)[:6]
        slots[t, : len(pick)] = torch.tensor(visible)[pick]
    out = sparse_latent_attention(q_latent, q_pe, cache, slots, 0.3, rank)
    for t in range(num_tokens):
        k = rows[slots[t][slots[t] >= 0]]
        scores = torch.einsum("hd,kd->hk", torch.cat((q_latent[t], q_pe[t]), -1), k) * 0.3
        want = scores.softmax(-1) @ k[:, :rank]
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


def test_sparse_attention_with_every_key_selected_is_dense_decode():
    rank, rope, heads = 12, 4, 3
    decodes = [1, 1, 1]
    cache, meta, _, gen = paged_batch(decodes, [5, 17, 9], heads_kv=1, dim=rank + rope, seed=4)
    q_latent, q_pe = torch.randn(3, heads, rank, generator=gen), torch.randn(3, heads, rope, generator=gen)
    slots = torch.where(meta.decode_mask, meta.decode_slot_index, -1)
    sparse = sparse_latent_attention(q_latent, q_pe, cache, slots, 0.3, rank)
    dense, _ = paged_latent_decode(q_latent, q_pe, cache, meta.block_tables, meta.seq_lens, rank, 0.3)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
