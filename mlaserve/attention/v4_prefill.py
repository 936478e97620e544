"""DeepSeek-V4's prefill attention on the paged Triton kernels: every query token of the step's prefills as one row
of the decode composition (attention/v4_decode.py), with its own context length (its position + 1) and its
sequence's tables.

A prefill token attends exactly as a decode row would at its position: to the `window` rows up to itself (the step
wrote every new row before attending), to the entries complete by then, (position + 1) // rate of them, and in a
compressed-sparse layer to the indexer's top-k of those. So the decode composition serves prefill unchanged once each
token carries its sequence's table rows: the tables are gathered per token (block ids, not cache rows). A token's
window never reaches before its prefill's first query's window, whose rows the window group still holds. Widths come
from the host's lengths, as in decode.
"""

import dataclasses

import torch
from torch import nn

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.v4_decode import decode_on_kernels


def per_token(meta: AttentionMetadata, seqs: torch.Tensor, seq_lens: torch.Tensor, longest: int):
    """meta with a row per query token: its sequence's table, its own context length; every host length the
    longest (only their maximum sizes the kernels' widths)."""
    rows = seqs.shape[0]
    return dataclasses.replace(
        meta,
        seq_lens=seq_lens,
        block_tables=meta.block_tables[seqs],
        num_decodes=rows,
        query_lens=[1] * rows,
        host_seq_lens=[longest] * rows,
    )


def prefill_on_kernels(
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
    """V4Attention._prefill's call (the prefills' tokens, after the step's decodes) through decode_on_kernels."""
    nd, end = meta.num_decodes, meta.num_seqs
    lens = torch.tensor(meta.query_lens[nd:end], device=q.device)
    seqs = torch.arange(nd, end, device=q.device).repeat_interleave(lens)
    seq_lens = (positions + 1).to(torch.int32)
    longest = max(meta.host_seq_lens[nd:end])
    token_entries = None if entries is None else per_token(entries, seqs, seq_lens, longest)
    return decode_on_kernels(
        attn, q, q_resid, hidden, positions, cached, per_token(meta, seqs, seq_lens, longest), token_entries,
        stored,
    )  # fmt: skip
