"""DeepSeek-V4's decode attention on the paged Triton kernels, as benchmarks/gpu_v4.py composes them per layer kind:

  window    mla_decode over the last `window` rows, read through the window group's table in its own pages from
            the tile the window starts in (the kernel masks the rows before it): the blocks before the window may
            be back in the pool, and the table names the null block there, which is never read
  entries   mla_decode over every complete entry, through the entry group's table (heavily compressed layers)
  selected  the indexer's top-k of the complete entries (kernels/index_topk.py), then mla_decode over them as
            pages of one row (compressed-sparse layers)

One row is both key and value (a rank of head_dim, no separate rotary part), and each part returns its output and
log-sum-exp; the parts are merged (kernels/v4_parts.py, one launch) with every head's sink logit as one more term
of the softmax's sum, which is the torch reference's single softmax (V4Attention._decode) over the same keys. Every
width is fixed by the host's lengths (max_model_len in a captured step) and nothing reads the device back, so a CUDA
graph can replay it.
"""

from typing import NamedTuple

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.kvcache.quant import row_width
from mlaserve.kvcache.segments import part_bounds


class Part(NamedTuple):
    """One kernel call's attention: out [B, H, D], lse [B, H] (natural log), lens [B] the keys it saw."""

    out: torch.Tensor
    lse: torch.Tensor
    lens: torch.Tensor


class IndexQuery(NamedTuple):
    """A compressed-sparse layer's selection: the indexer's queries [B, heads, dim] (rotated) and weights [B, heads]
    float32, whose sum over heads of weight x relu(scale x q.key) scores each entry; each query keeps `topk`."""

    q: torch.Tensor
    weights: torch.Tensor
    scale: float
    topk: int


class EntryCache(NamedTuple):
    """A layer's compressed entries: cache [blocks, page, 1, width] (the kv, then the indexer key), the entry
    group's tables [>= B, max_blocks], `rate` tokens an entry, `max_count` the most complete entries a sequence of
    the step may have (from the host's lengths), and the indexer's selection where the layer has one."""

    cache: torch.Tensor
    tables: torch.Tensor
    rate: int
    max_count: int
    index: IndexQuery | None = None


def attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    window: int = 0,
) -> Part:
    """mla_decode of q [B, H, D] over the first D features of cache's rows ([blocks, page, 1, >= D]; in an 8-bit
    cache the first part, D values and their scale's tail, kvcache/segments.py); with a window, each sequence's
    last `window` rows."""
    from mlaserve.kernels.mla_decode.decode import mla_decode

    d = q.shape[-1]
    width = row_width(d, cache.dtype)
    out, lse = mla_decode(q, cache[..., :width], table, lens, max_len, d, scale, window=window)
    return Part(out, lse, lens)


def one_row_pages(cache: torch.Tensor) -> torch.Tensor:
    """cache [blocks, page, 1, width] as pages of one row, whose block ids are the flat slots."""
    return cache.view(-1, 1, 1, cache.shape[-1])


def select_slots(
    q: torch.Tensor, entries: EntryCache, counts: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's top-k of each sequence's complete entries (counts [B] int32; rows [B] int32 each sequence's
    table row): (slots [B, k] int32 of the entry cache, the picked first and 0 after them; lens [B] int32 how many
    were picked)."""
    from mlaserve.kernels.index_topk import select_topk_paged

    index, d = entries.index, q.shape[-1]
    keys = entries.cache[..., part_bounds((d, index.q.shape[-1]), 1, entries.cache.dtype)]
    lens = torch.empty(q.shape[0], dtype=torch.int32, device=q.device)
    slots = select_topk_paged(
        index.q, index.weights, keys, entries.tables[: q.shape[0]], rows, counts, entries.max_count,
        index.topk, index.scale, lens,
    )  # fmt: skip
    return slots, lens


def attend_selected(
    q: torch.Tensor, entries: EntryCache, selected: tuple[torch.Tensor, torch.Tensor], scale: float
) -> Part:
    """Attention over the selected entries (select_slots), read as pages of one row."""
    slots, lens = selected
    return attend(q, one_row_pages(entries.cache), slots, lens, slots.shape[1], scale)


def merge_with_sink(parts: list[Part], sink: torch.Tensor) -> torch.Tensor:
    """[B, H, D] float32: the parts' outputs weighted by their share of one softmax whose sum also holds
    exp(sink[h]). A part with no keys adds nothing (the kernels leave its output undefined). The reference of
    kernels/v4_parts.py's merge, which v4_decode runs."""
    lses = [torch.where(p.lens[:, None] > 0, p.lse, float("-inf")) for p in parts]
    top = torch.stack([*lses, sink[None].expand_as(lses[0])]).amax(dim=0)
    total = torch.exp(sink[None] - top)
    out = torch.zeros_like(parts[0].out, dtype=torch.float32)
    for part, lse in zip(parts, lses, strict=True):
        w = torch.exp(lse - top)
        total = total + w
        out += torch.where(part.lens[:, None, None] > 0, part.out.float(), 0.0) * w[..., None]
    return out / total[..., None]


def v4_decode(
    q: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    rows: torch.Tensor,
    window_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    entries: EntryCache | None = None,
) -> torch.Tensor:
    """Decode attention [B, H, D] in q's dtype of queries q [B, H, D] (D: head_dim) over the rows' cache [blocks,
    page, 1, >= D] (window group; window_tables [>= B, max_blocks]) and a compressing layer's entries, with each
    head's sink logit (sink [H]) in its softmax. seq_lens [B]: the context after this step."""
    from mlaserve.kernels import v4_parts

    b = q.shape[0]
    parts = [attend(q, rows, window_tables[:b], seq_lens, window, scale, window)]
    if entries is not None and entries.max_count:
        step = v4_parts.entry_rows(seq_lens, entries.rate)
        if entries.index is None:
            parts.append(attend(q, entries.cache, entries.tables[:b], step.counts, entries.max_count, scale))
        else:
            selected = select_slots(q, entries, step.counts, step.rows)
            parts.append(attend_selected(q, entries, selected, scale))
    return v4_parts.merge_with_sink(parts, sink, q.dtype)


def decode_on_kernels(
    attn: nn.Module,
    q: torch.Tensor,
    q_resid: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cached: torch.Tensor,
    meta: AttentionMetadata,
    entries: AttentionMetadata | None,
    stored: torch.Tensor | None,
) -> torch.Tensor:
    """V4Attention._decode's call (the same arguments, `attn` the layer) through v4_decode: the rows and entries
    flat as the layer holds them ([slots, width]), the entry group's metadata `entries`."""
    b, page = q.shape[0], meta.block_size
    entry = None
    if entries is not None:
        rate = attn.compressor.rate
        index = None
        if attn.indexer is not None:
            index_q, weights = attn.indexer.queries(q_resid, hidden, *attn.entry_rotary.cos_sin(positions))
            index = IndexQuery(index_q, weights, attn.indexer.head_dim**-0.5, attn.indexer.topk)
        cache = stored.view(-1, page, 1, stored.shape[-1])
        entry = EntryCache(cache, entries.block_tables, rate, max(meta.host_seq_lens[:b]) // rate, index)
    rows = cached.view(-1, page, 1, cached.shape[-1])
    return v4_decode(
        q, attn.attn_sink, attn.scale, rows, meta.block_tables, meta.seq_lens[:b], attn.window, entry
    )


def describe_v4_decode(
    backend: AttentionBackend,
    num_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    device: torch.device,
    query_dtype: torch.dtype,
) -> str:
    """What runs DeepSeek-V4's attention, for the start-up log and stats(): its decode and prefill take the same
    kernels (attention/v4_prefill.py) where the backend runs them."""
    if not backend.paged_kernels:
        return "torch reference (DeepSeek-V4's own decode and prefill)"
    kernel = backend.decode_kernel(num_heads, head_dim, 0, cache_dtype, 1, device, query_dtype)
    return (
        f"{kernel} over the window's rows and the compressed entries, merged with the sinks; triton index scores"
        " + torch.topk for compressed-sparse layers; prefill tokens as rows of the same kernels"
    )
