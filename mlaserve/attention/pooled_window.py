"""Training-free compressed attention for any model with per-head K/V caches (the engine's `compress_ratio`).

Each query attends exactly to the last `window` tokens (and the sequence's first `sinks` tokens); everything older
is seen through mean-pooled entries, one per `ratio` consecutive tokens: the mean of the group's cached (rotated)
keys and of its values, its score raised by log(ratio), so an entry weighs as much in the softmax as the `ratio`
keys it stands for would if they were all alike. This is DeepSeek-V4's heavily compressed attention with a mean
where V4 learns a gated pooling, applied to a model that was not trained for it.

Groups are fixed by position (tokens g * ratio .. (g + 1) * ratio - 1), so the answer does not depend on the block
size, the chunking of a prompt or the batch. A group is pooled for a query once all of it lies before the query's
window; the tokens before the window that share a group with the window's first tokens stay exact, so the exact
span reaches back to the start of that group (up to window + ratio - 1 tokens).

The engine keeps two cache groups (docs/cache-groups.md): a window group of window + ratio - 1 tokens (and the
sinks), whose older blocks go back to the pool, and a group of pooled entries, `block_size` entries a block,
each written once by the step that completes it (write_pooled_entries) from rows the window group still holds;
paged_pooled_attention reads both. pooled_window_attention is its reference: it pools from full-rate rows of a
table that holds every token, at every step. Torch attention, per sequence; lossy by design:
benchmarks/quality.py measures what it costs.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlaserve.attention.backend import write_to_cache
from mlaserve.attention.metadata import AttentionMetadata, slot_indices


@dataclass(frozen=True)
class PooledWindow:
    window: int  # exact over the last `window` tokens, the query itself included
    ratio: int  # tokens per pooled entry
    sinks: int = 0  # the sequence's first tokens, always exact (a multiple of ratio)

    def exact_start(self, q_pos: torch.Tensor) -> torch.Tensor:
        """Per query, the first position it sees exactly (sinks aside): its window's start, back to a group start."""
        return (q_pos - self.window + 1).clamp(min=0) // self.ratio * self.ratio

    def masks(
        self, q_pos: torch.Tensor, key_pos: torch.Tensor, entries: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([q, keys] exact keys, [q, entries] pooled entries) that queries at positions q_pos see, among cached keys
        at positions key_pos and the pooled entries (group indices) given."""
        start = self.exact_start(q_pos)[:, None]
        exact = (key_pos[None, :] <= q_pos[:, None]) & (
            (key_pos[None, :] >= start) | (key_pos[None, :] < self.sinks)
        )
        pooled = (entries[None, :] >= self.sinks // self.ratio) & (
            (entries[None, :] + 1) * self.ratio <= start
        )
        return exact, pooled


def pooled_window_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rule: PooledWindow,
) -> torch.Tensor:
    """The reference: every sequence's queries ([T, H, D], this step's K/V already cached) over its exact span and
    entries pooled here from the full-rate rows of one table that holds every token."""
    return _attend_per_sequence(q, k_cache, v_cache, meta, None, scale, rule)


def paged_pooled_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    entries: AttentionMetadata,
    scale: float,
    rule: PooledWindow,
) -> torch.Tensor:
    """The engine's: the exact span from the window group's table (`meta`, which holds the sinks and the last
    window + ratio - 1 tokens), the pooled entries from the entries group's (`entries`), as write_pooled_entries
    left them."""
    return _attend_per_sequence(q, k_cache, v_cache, meta, entries, scale, rule)


def write_pooled_entries(cache: torch.Tensor, entries: AttentionMetadata) -> None:
    """Pool and store the entries this step completes (after its own rows are cached): the mean of each one's
    `ratio` rows, in float32, stored in the cache's dtype."""
    if entries.slot_mapping.numel() == 0:
        return
    rows = cache.view(-1, *cache.shape[2:])[entries.pooled_sources]  # [entries, ratio, Hkv, D]
    write_to_cache(cache, entries.slot_mapping, rows.float().mean(1))


def _attend_per_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    entries: AttentionMetadata | None,
    scale: float,
    rule: PooledWindow,
) -> torch.Tensor:
    """entries None: pool from meta's full-rate rows (the reference); else read the stored entries."""
    out, start = [], 0
    bias = math.log(rule.ratio)
    cache_k, cache_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for i, (q_len, n) in enumerate(zip(meta.query_lens, meta.host_seq_lens, strict=True)):
        q_pos = torch.arange(n - q_len, n, device=q.device)
        # Only what some query of this step reads: the sinks and the keys from the first query's exact span on,
        # and the groups before the last query's span (the queries' spans only move forward).
        first, last = (int(x) for x in rule.exact_start(q_pos[[0, -1]]))
        sinks = min(rule.sinks, first)
        key_pos = torch.cat((torch.arange(sinks, device=q.device), torch.arange(first, n, device=q.device)))
        pooled_from = rule.sinks // rule.ratio * rule.ratio
        pooled_to = max(last, pooled_from)
        table, size = meta.block_tables[i], meta.block_size
        slots = torch.cat((slot_indices(table, sinks, size), slot_indices(table, n, size, first)))
        k, v = cache_k[slots].float(), cache_v[slots].float()  # [keys, Hkv, D]
        first_entry, count = pooled_from // rule.ratio, (pooled_to - pooled_from) // rule.ratio
        if entries is None:
            pool_slots = slot_indices(table, pooled_to, size, pooled_from)
            k_pool = cache_k[pool_slots].float().view(count, rule.ratio, *k.shape[1:]).mean(1)
            v_pool = cache_v[pool_slots].float().view(count, rule.ratio, *v.shape[1:]).mean(1)
        else:  # entry e sits at row e % size of block e // size of the entries table
            entry_slots = slot_indices(entries.block_tables[i], first_entry + count, size, first_entry)
            k_pool, v_pool = cache_k[entry_slots].float(), cache_v[entry_slots].float()
        entry_ids = torch.arange(first_entry, first_entry + count, device=q.device)
        exact, pooled = rule.masks(q_pos, key_pos, entry_ids)
        keys, values = torch.cat((k, k_pool)), torch.cat((v, v_pool))
        # One additive mask: 0 for an exact key, log(ratio) for a pooled entry, -inf for what the query does not see
        # (each query sees at least itself). SDPA fuses the rest and reads each KV head for its query heads.
        mask = torch.cat((exact.float().log(), pooled.float().log() + bias), dim=1)
        qi = q[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        attended = F.scaled_dot_product_attention(
            qi, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out.append(attended.transpose(0, 1).to(q.dtype))
        start += q_len
    return torch.cat(out)
