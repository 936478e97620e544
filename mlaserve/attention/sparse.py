"""Sparse MLA (DeepSeek-V3.2): the indexer picks each query's top-k cached tokens, attention reads only those.

A selection is a [num_tokens, k] tensor of flat cache slots, -1 where a query has fewer than k tokens to choose
from (FlashMLA's sparse kernels take the same layout). These torch functions are the reference the GPU kernels
are tested against, and the path on every other device; both bound their temporaries by working through the
queries in slices, since a long prefill chunk against a long context would not fit in memory at once.
"""

import torch

from mlaserve.attention.metadata import AttentionMetadata, causal_mask
from mlaserve.kvcache.quant import dequantize_rows, is_quantized

_SLICE_ELEMENTS = 1 << 24  # float32 temporaries of one slice of queries: 64 MiB


def cached_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a paged one-head cache ([blocks, page, 1, W]) at flat slots (any shape), float32, 8-bit dequantized."""
    rows = cache.flatten(0, 2).index_select(0, slots.reshape(-1).clamp(min=0))
    rows = dequantize_rows(rows, torch.float32) if is_quantized(cache.dtype) else rows.float()
    return rows.view(*slots.shape, rows.shape[-1])


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's score of each key for each query: sum over heads h of
    weights[h] * relu(scale * q[h] . key). q [n, H, D], weights [n, H], keys [n, L, D] or [L, D] -> [n, L]."""
    pattern = "nhd,nld->nhl" if keys.dim() == 3 else "nhd,ld->nhl"
    scores = torch.einsum(pattern, q.float(), keys.float()).mul_(scale).relu_()
    return torch.einsum("nh,nhl->nl", weights.float(), scores)


def _top_slots(scores: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """The slots of each row's k best scores; -inf scores (keys the query may not see) come back as -1."""
    values, idx = scores.topk(min(k, scores.shape[-1]), dim=-1)
    picked = slots.gather(-1, idx) if slots.dim() == 2 else slots[idx]
    return picked.masked_fill_(values == float("-inf"), -1)


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    meta: AttentionMetadata,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """Each query token's top-k cached tokens by index score, among those it may see (causal): [T, k] flat slots
    with k = min(topk, longest context), -1 padded. q [T, H, D] roped indexer queries, weights [T, H]."""
    k = min(topk, max(meta.host_seq_lens))
    out = torch.full((q.shape[0], k), -1, dtype=torch.long, device=q.device)
    nd = meta.num_decodes
    if nd:
        index = meta.decode_slot_index  # [B, L]: each decode's context, masked past its length
        step = max(1, _SLICE_ELEMENTS // (index.shape[1] * (q.shape[1] + q.shape[2])))
        for s in range(0, nd, step):
            rows = slice(s, min(nd, s + step))
            scores = index_scores(q[rows], weights[rows], cached_rows(key_cache, index[rows]), scale)
            scores.masked_fill_(~meta.decode_mask[rows], float("-inf"))
            top = _top_slots(scores, index[rows], k)
            out[rows, : top.shape[1]] = top
    t0, c0 = nd, 0
    for q_len, kv_len in zip(meta.prefill_query_lens, meta.prefill_seq_lens, strict=True):
        slots = meta.prefill_slot_index[c0 : c0 + kv_len]
        keys = cached_rows(key_cache, slots)
        visible = causal_mask(q_len, kv_len, q.device)
        step = max(1, _SLICE_ELEMENTS // (kv_len * q.shape[1]))
        for s in range(0, q_len, step):
            rows = slice(t0 + s, t0 + min(q_len, s + step))
            scores = index_scores(q[rows], weights[rows], keys, scale)
            scores.masked_fill_(~visible[s : s + step], float("-inf"))
            top = _top_slots(scores, slots, k)
            out[rows, : top.shape[1]] = top
        t0, c0 = t0 + q_len, c0 + kv_len
    return out


def sparse_latent_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed MLA over only the selected latent rows: q_latent [T, H, R], q_pe [T, H, P], slots [T, k] (-1 for
    none) -> [T, H, R] in q's dtype. Prefill and decode alike, since each query has its own row set."""
    num_tokens, heads, _ = q_latent.shape
    out = torch.empty_like(q_latent)
    step = max(1, _SLICE_ELEMENTS // (slots.shape[1] * (cache.shape[-1] + heads)))
    for s in range(0, num_tokens, step):
        sel = slots[s : s + step]
        rows = cached_rows(cache, sel)  # [n, k, R + P]
        q = torch.cat((q_latent[s : s + step], q_pe[s : s + step]), dim=-1).float()
        scores = torch.einsum("nhd,nkd->nhk", q, rows).mul_(scale)
        scores.masked_fill_((sel < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s : s + step] = torch.einsum("nhk,nkr->nhr", probs, rows[..., :kv_lora_rank]).to(out.dtype)
    return out
