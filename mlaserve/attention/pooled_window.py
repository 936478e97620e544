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

This is the torch reference: per sequence the whole context is gathered and every entry pooled from it, so the
cache holds every token, as the exact model's does (no memory is saved yet: that takes a cache group of pooled
entries, whose blocks would replace those the window gives back). It is lossy by design; benchmarks/quality.py
measures what it costs.
"""

import math
from dataclasses import dataclass

import torch

from mlaserve.attention.metadata import AttentionMetadata, slot_indices


@dataclass(frozen=True)
class PooledWindow:
    window: int  # exact over the last `window` tokens, the query itself included
    ratio: int  # tokens per pooled entry
    sinks: int = 0  # the sequence's first tokens, always exact (a multiple of ratio)

    def exact_start(self, q_pos: torch.Tensor) -> torch.Tensor:
        """Per query, the first position it sees exactly (sinks aside): its window's start, back to a group start."""
        return (q_pos - self.window + 1).clamp(min=0) // self.ratio * self.ratio

    def masks(self, q_pos: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([q, n] exact keys, [q, n // ratio] pooled entries) each query at positions q_pos sees, in a context of
        n cached tokens (only whole groups are pooled)."""
        start = self.exact_start(q_pos)[:, None]
        keys = torch.arange(n, device=q_pos.device)[None, :]
        exact = (keys <= q_pos[:, None]) & ((keys >= start) | (keys < self.sinks))
        entries = torch.arange(n // self.ratio, device=q_pos.device)[None, :]
        pooled = (entries >= self.sinks // self.ratio) & ((entries + 1) * self.ratio <= start)
        return exact, pooled


def pooled_window_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rule: PooledWindow,
) -> torch.Tensor:
    """Every sequence's queries ([T, H, D], this step's K/V already cached) over its exact span and pooled entries."""
    out, start = [], 0
    bias = math.log(rule.ratio)
    for i, (q_len, n) in enumerate(zip(meta.query_lens, meta.host_seq_lens, strict=True)):
        slots = slot_indices(meta.block_tables[i], n, meta.block_size)
        k = k_cache.flatten(0, 1)[slots].float()  # [n, Hkv, D]
        v = v_cache.flatten(0, 1)[slots].float()
        count = n // rule.ratio
        k_pool = k[: count * rule.ratio].view(count, rule.ratio, *k.shape[1:]).mean(1)
        v_pool = v[: count * rule.ratio].view(count, rule.ratio, *v.shape[1:]).mean(1)
        exact, pooled = rule.masks(torch.arange(n - q_len, n, device=q.device), n)
        qi = q[start : start + q_len].float()
        groups = qi.shape[1] // k.shape[1]
        keys = torch.cat((k, k_pool)).repeat_interleave(groups, 1)
        values = torch.cat((v, v_pool)).repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        scores[..., n:] += bias
        visible = torch.cat((exact, pooled), dim=1)
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype))
        start += q_len
    return torch.cat(out)
