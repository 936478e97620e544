"""The training-free compress_ratio (attention/pooled_window.py): its attention against a per-query definition
written out longhand, then the engine's tokens under it: exact when the window covers the context, lossy but
independent of chunking, batching and prefix-cache hits otherwise, and bad settings refused before any weight
loads."""

import math

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.pooled_window import PooledWindow, pooled_window_attention
from tests.engine.test_sliding_window import prompts
from tests.tiny_models import build_tiny


def attention_by_definition(q, k, v, q_pos: int, rule: PooledWindow, scale: float) -> torch.Tensor:
    """One query [H, D] at q_pos over keys/values [n, Hkv, D] at positions 0..n-1: every key it sees exactly, and
    one entry per whole group of `ratio` tokens that ends before its exact span (after the sinks), mean key and
    value, its score raised by log(ratio)."""
    first_exact = max(0, q_pos - rule.window + 1) // rule.ratio * rule.ratio
    keys, values, bias = [], [], []
    for g in range(rule.sinks // rule.ratio, first_exact // rule.ratio):
        span = slice(g * rule.ratio, (g + 1) * rule.ratio)
        keys.append(k[span].mean(0))
        values.append(v[span].mean(0))
        bias.append(math.log(rule.ratio))
    for pos in range(q_pos + 1):
        if pos >= first_exact or pos < rule.sinks:
            keys.append(k[pos])
            values.append(v[pos])
            bias.append(0.0)
    keys, values = torch.stack(keys), torch.stack(values)  # [m, Hkv, D]
    groups = q.shape[0] // k.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = torch.einsum("hd,mhd->hm", q, keys) * scale + torch.tensor(bias)
    return torch.einsum("hm,mhd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    "rule", [PooledWindow(8, 4), PooledWindow(6, 4, sinks=4), PooledWindow(5, 2), PooledWindow(64, 4)]
)
def test_matches_its_definition(rule: PooledWindow) -> None:
    gen = torch.Generator().manual_seed(rule.window * 7 + rule.ratio)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    query_lens, seq_lens = [1, 1, 9, 30], [23, 5, 9, 41]  # two decodes, a fresh prompt, a chunk after context
    # Each sequence its own blocks, drawn from one shuffle of the pool (block 0 is the null block).
    caches = torch.zeros(2, 1 + sum(-(-n // block) for n in seq_lens), block, kv_heads, dim)
    order = torch.randperm(caches.shape[1] - 1, generator=gen).int() + 1
    tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // block), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        blocks = -(-n // block)
        tables[i, :blocks] = order[used : used + blocks]
        used += blocks
    kv = torch.randn(2, sum(seq_lens), kv_heads, dim, generator=gen)
    start = 0
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[i, pos // block].long() * block + pos % block
        caches[0].flatten(0, 1)[slots] = kv[0, start : start + n]
        caches[1].flatten(0, 1)[slots] = kv[1, start : start + n]
        start += n
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    meta = build_metadata(
        block, tables, query_lens, seq_lens, 2, torch.zeros(sum(query_lens), dtype=torch.long)
    )
    got = pooled_window_attention(q, caches[0], caches[1], meta, 0.3, rule)
    row, start = 0, 0
    for q_len, n in zip(query_lens, seq_lens, strict=True):
        k, v = kv[0, start : start + n], kv[1, start : start + n]
        for j in range(q_len):
            want = attention_by_definition(q[row], k, v, n - q_len + j, rule, 0.3)
            torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)
            row += 1
        start += n


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("llama"))


def generate(
    path, batch: list[list[int]] | None = None, hits: list | None = None, **options
) -> list[list[int]]:
    """Greedy tokens of the batch; hits, when given, gets the prefix-cache hit count."""
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=200, **options)
    batch = batch or prompts(4, seed=3, low=30, high=70)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if hits is not None:
        hits.append(stats["prefix_cache_hits"])
    return [o.outputs[0].token_ids for o in outs]


def test_a_window_over_the_whole_context_is_exact_attention(llama):
    assert generate(llama, sliding_window=200, compress_ratio=4) == generate(llama)


def test_pooled_tokens_do_not_depend_on_chunking_batching_or_prefix_hits(llama):
    options = dict(sliding_window=12, num_sink_tokens=4, compress_ratio=4)
    pooled = generate(llama, **options)
    assert pooled != generate(llama)  # lossy: a 12-token window over 50-90 tokens of context
    assert pooled != generate(llama, sliding_window=12, num_sink_tokens=4)  # the pooled entries are read
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=11)
    assert generate(llama, **options, **chunked) == pooled
    assert generate(llama, **options, max_num_seqs=1) == pooled
    # The same prompts again behind a shared 40-token prefix that a first request puts in the prefix cache.
    batch = prompts(4, seed=3, low=30, high=70)
    shared = [batch[0][:40] + p for p in batch]
    cold = generate(llama, shared, **options, max_num_seqs=1, enable_prefix_caching=False)
    hits = []
    assert generate(llama, shared, hits, **options, max_num_seqs=1) == cold
    assert hits[0] >= 3 * 40  # the three later requests read the shared prefix from the cache


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(compress_ratio=4), "compress_ratio=4: must be unset unless sliding_window is set"),
        (dict(sliding_window=16, compress_ratio=1), "compress_ratio=1: must be an int >= 2"),
        (dict(sliding_window=16, compress_ratio=32), "compress_ratio=32: must be at most sliding_window"),
        (
            dict(sliding_window=16, num_sink_tokens=6, compress_ratio=4),
            "compress_ratio=4: must be a divisor of num_sink_tokens",
        ),
    ],
)
def test_bad_settings_are_refused_before_any_weight_loads(llama, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama), device="cpu", **options)


def test_refused_for_latent_caches(tmp_path):
    mla = build_tiny("deepseek_v2", tmp_path)
    with pytest.raises(ValueError, match="applies to models with per-head K/V caches"):
        LLM(str(mla), device="cpu", sliding_window=16, compress_ratio=4, load_format="dummy")
