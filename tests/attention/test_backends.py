"""Attention backends against plain per-sequence attention on fresh random paged caches."""

import pytest
import torch

from mlaserve.attention.backend import write_to_cache
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.attention.selector import select_backend
from mlaserve.attention.torch_ref import TorchBackend

BLOCK = 4


def paged_batch(query_lens, seq_lens, num_blocks=64, heads_kv=2, dim=8, seed=0):
    """A cache with random contents and a random (shuffled) block table per sequence."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, BLOCK, heads_kv, dim, generator=gen)
    free = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables, used = [], 0
    for n in seq_lens:
        k = -(-n // BLOCK)
        tables.append(free[used : used + k].tolist())
        used += k
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    slots = [
        table[i, p // BLOCK].item() * BLOCK + p % BLOCK
        for i, (q, n) in enumerate(zip(query_lens, seq_lens))
        for p in range(n - q, n)
    ]
    num_decodes = sum(1 for q in query_lens if q == 1)
    meta = build_metadata(BLOCK, table, list(query_lens), list(seq_lens), num_decodes, torch.tensor(slots))
    flat = cache.flatten(0, 1)
    contexts = [
        flat[torch.tensor([int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)])]
        for i, n in enumerate(seq_lens)
    ]
    return cache, meta, contexts, gen


def naive(q, k, v, scale):
    """q [Lq, H, D], k/v [Lk, Hkv, D]; bottom-right causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] > torch.arange(lk - lq, lk)[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", [TorchBackend(), SdpaBackend()])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_matches_naive(backend, seed):
    query_lens, seq_lens = [1, 1, 5, 9, 3], [7, 13, 5, 17, 11]  # decodes first, then prefills with context
    cache, meta, contexts, gen = paged_batch(query_lens, seq_lens, seed=seed)
    values = torch.randn_like(cache)
    q = torch.randn(sum(query_lens[2:]), 4, 8, generator=gen)
    k = backend.gather_prefill_context(cache, meta)
    v = backend.gather_prefill_context(values, meta)
    out = backend.prefill(q, k, v, meta, 0.3)
    start, kstart = 0, 0
    for i in range(2, 5):
        n, lq = seq_lens[i], query_lens[i]
        want = naive(q[start : start + lq], k[kstart : kstart + n], v[kstart : kstart + n], 0.3)
        torch.testing.assert_close(out[start : start + lq], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k[kstart : kstart + n], contexts[i])
        start, kstart = start + lq, kstart + n


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("backend", [TorchBackend(), SdpaBackend()])
def test_decode_matches_naive(backend, seed, latent):
    query_lens, seq_lens = [1, 1, 1, 1], [1, 9, 4, 30]
    heads_kv = 1 if latent else 2
    cache, meta, contexts, gen = paged_batch(query_lens, seq_lens, heads_kv=heads_kv, dim=12, seed=seed)
    values = None if latent else torch.randn(cache.shape[:-1] + (6,), generator=gen)
    q = torch.randn(4, 4, 12, generator=gen)
    out, lse = backend.decode(q, cache, values, meta, 0.25, 6, need_lse=True)
    fast, _ = backend.decode(q, cache, values, meta, 0.25, 6)
    torch.testing.assert_close(fast, out, atol=1e-5, rtol=1e-5)
    for i, n in enumerate(seq_lens):
        k = contexts[i]
        v = k[..., :6] if latent else values.flatten(0, 1)[meta.decode_slot_index[i, :n]]
        torch.testing.assert_close(out[i], naive(q[i : i + 1], k, v, 0.25)[0], atol=1e-5, rtol=1e-5)
        groups = 4 // heads_kv
        scores = torch.einsum("hd,khd->hk", q[i], k.repeat_interleave(groups, 1)) * 0.25
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_write_to_cache_places_rows_at_slots():
    cache = torch.zeros(4, BLOCK, 1, 3)
    write_to_cache(cache, torch.tensor([5, 0, 15]), torch.arange(9.0).view(3, 1, 3))
    flat = cache.view(-1, 1, 3)
    assert (
        flat[5, 0].tolist() == [0, 1, 2]
        and flat[0, 0].tolist() == [3, 4, 5]
        and flat[15, 0].tolist() == [6, 7, 8]
    )


def test_selector_logs_and_rejects_unknown(caplog):
    with caplog.at_level("INFO"):
        backend = select_backend(torch.device("cpu"))
    assert backend.name in caplog.text
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention_backend 'flashmla'"):
        select_backend(torch.device("cpu"), "flashmla")
