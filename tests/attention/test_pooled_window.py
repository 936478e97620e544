"""The training-free compress_ratio (attention/pooled_window.py): its attention against a per-query definition
written out longhand, then the engine's tokens under it: exact when the window covers the context, lossy but
independent of chunking, batching and prefix-cache hits otherwise, and bad settings refused before any weight
loads."""

import math

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.metadata import AttentionMetadata, build_metadata
from mlaserve.attention.pooled_window import (
    PooledWindow,
    paged_pooled_attention,
    pooled_window_attention,
    write_pooled_entries,
)
from mlaserve.runner.batch import entry_rows
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import prompts


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


@pytest.mark.parametrize("rule", [PooledWindow(8, 4), PooledWindow(6, 4, sinks=4), PooledWindow(5, 2)])
def test_the_window_and_entries_groups_give_the_reference(rule: PooledWindow) -> None:
    """The engine's layout against the reference over full-rate rows: the window group holds only the sinks and
    what the step's queries read exactly (every other block is the null block, full of NaN, so a read of a block
    the window gave back shows), entries are pooled into their own blocks by the steps that complete them."""
    gen = torch.Generator().manual_seed(rule.window + 3 * rule.ratio)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    query_lens, seq_lens = [1, 1, 9, 30], [23, 5, 9, 41]
    full_blocks = [-(-n // block) for n in seq_lens]
    entry_blocks = [-(-n // (block * rule.ratio)) for n in seq_lens]
    caches = torch.zeros(2, 1 + sum(full_blocks) + sum(entry_blocks), block, kv_heads, dim)
    order = (torch.randperm(caches.shape[1] - 1, generator=gen) + 1).int()
    full = torch.zeros(len(seq_lens), max(full_blocks), dtype=torch.int32)
    entries = torch.zeros(len(seq_lens), max(entry_blocks), dtype=torch.int32)
    used = 0
    for i, (nf, ne) in enumerate(zip(full_blocks, entry_blocks, strict=True)):
        full[i, :nf], entries[i, :ne] = order[used : used + nf], order[used + nf : used + nf + ne]
        used += nf + ne
    kv = torch.randn(2, sum(seq_lens), kv_heads, dim, generator=gen)
    rows = torch.cat([torch.full((n,), i) for i, n in enumerate(seq_lens)])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    slots = full[rows, positions // block].long() * block + positions % block
    caches[:, 1:].flatten(1, 2)[:, slots - block] = kv  # every token's row (the null block stays zero)
    # Every entry any step completed, pooled as the engine's steps would have, from the rows in the window group.
    done, entry_slots, sources, _ = entry_rows(entries, full, rows, positions, block, rule.ratio, rule.ratio)
    entry_slots, sources = entry_slots[done], sources[done]
    entry_meta = AttentionMetadata(
        block, entry_slots, torch.tensor(seq_lens), entries, 2, query_lens, seq_lens
    )
    entry_meta.pooled_sources = sources
    write_pooled_entries(caches[0], entry_meta)
    write_pooled_entries(caches[1], entry_meta)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    no_writes = torch.zeros(sum(query_lens), dtype=torch.long)
    want = pooled_window_attention(
        q, caches[0], caches[1], build_metadata(block, full, query_lens, seq_lens, 2, no_writes), 0.3, rule
    )
    # The window group's tables: the sinks' blocks and those from each step's first exact position on.
    window = full.clone()
    for i, (q_len, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first = int(rule.exact_start(torch.tensor(n - q_len)))
        keep = set(range(-(-rule.sinks // block))) | set(range(first // block, full_blocks[i]))
        for b in range(full_blocks[i]):
            window[i, b] = full[i, b] if b in keep else 0
    caches[:, 0] = float("nan")
    got = paged_pooled_attention(
        q,
        caches[0],
        caches[1],
        build_metadata(block, window, query_lens, seq_lens, 2, no_writes, False),
        entry_meta,
        0.3,
        rule,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_long_generation_holds_the_window_and_one_entry_per_ratio_tokens(llama):
    llm = LLM(
        str(llama), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32,
        sliding_window=12, num_sink_tokens=4, compress_ratio=4,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompts(1, seed=5, low=40, high=41)[0]}, params)
    most = [0, 0]
    while engine.has_unfinished_requests():
        engine.step(stream=False)
        blocks = engine.stats()["kv_blocks_by_group"]
        most = [max(m, b) for m, b in zip(most, blocks, strict=True)]
    # 440 tokens: the window group holds the sink block and 12 + 3 tokens of window (and the step's own tokens),
    # the entries group one block per 4 x 4 tokens. A full-rate cache would hold 110 blocks (more than the pool).
    assert most[0] <= 1 + -(-(12 + 3 + 32) // 4) + 1, most
    assert most[1] == -(-440 // 16), most
    assert llm.stats()["kv_blocks_used"] == 0


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
    # The three later requests read the shared prefix from the cache, to a boundary of every group: the pooled
    # entries' blocks span block_size x ratio = 16 tokens.
    assert hits[0] >= 3 * 32


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


def test_refused_when_every_layer_has_its_own_window(tmp_path):
    mistral = build_tiny("mistral", tmp_path, sliding_window=64)
    with pytest.raises(ValueError, match="every layer of MistralForCausalLM attends through its own window"):
        LLM(str(mistral), device="cpu", sliding_window=16, compress_ratio=4, load_format="dummy")


def test_a_model_with_windows_of_its_own_pools_only_its_full_attention_layers(tmp_path):
    # Qwen2 windows its first two layers itself (24 tokens); the other two are pooled: three cache groups.
    qwen2 = build_tiny(
        "qwen2", tmp_path, num_hidden_layers=4, use_sliding_window=True, sliding_window=24, max_window_layers=2,
    )  # fmt: skip
    options = dict(sliding_window=12, num_sink_tokens=4, compress_ratio=4, max_model_len=128)
    llm = LLM(str(qwen2), dtype="float32", device="cpu", block_size=4, num_kv_blocks=200, **options)
    groups = llm.stats()["kv_cache_groups"]
    window = groups.index("window 15 + 4 sink tokens: 2 layers, 512 bytes/token")  # 12 + ratio - 1
    assert sorted(groups[:2]) == sorted(["window 24: 2 layers, 512 bytes/token", groups[window]])
    assert groups[2] == f"pooled 1:4 of group {window}: 512 bytes/entry"
    pooled = generate(qwen2, **options)
    assert pooled != generate(qwen2, max_model_len=128)
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=11)
    assert generate(qwen2, **options, **chunked) == pooled
    assert generate(qwen2, **options, max_num_seqs=1) == pooled
