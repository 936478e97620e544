"""The one attention metadata object: built once per step by the runner, read by every layer and backend.

The batch is ordered decodes first (one query token each), then prefills (chunks of one or more prompts). Both
read the same paged cache, so a prefill chunk attends to everything cached before it: earlier chunks and
prefix-cache hits alike.
"""

from dataclasses import dataclass

import torch

from mlaserve.host_copy import queued_values


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """True where query j (position kv_len - q_len + j) may see key i: i <= that position. (Windows and sinks:
    AttentionMetadata.prefill_mask.)"""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each new token's KV is written to
    seq_lens: torch.Tensor  # [num_seqs] context length after this step, new tokens included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 block ids (0 pads)
    num_decodes: int  # the first num_decodes sequences (and tokens) have one query token
    query_lens: list[int]  # per sequence, host side
    host_seq_lens: list[int]  # per sequence, host side
    # Gather indices for the paged reference paths, computed once per step instead of once per layer.
    decode_slot_index: torch.Tensor | None = None  # [num_decodes, max_decode_len] slots (0 where masked)
    decode_mask: torch.Tensor | None = None  # [num_decodes, max_decode_len] True where a key exists
    prefill_slot_index: torch.Tensor | None = (
        None  # [sum of prefill seq_lens] slots of every prefill's context
    )
    # int32 offsets of each prefill's queries and context in the concatenated tensors (varlen kernels)
    prefill_cu_query_lens: torch.Tensor | None = None  # [num_prefills + 1]
    prefill_cu_seq_lens: torch.Tensor | None = None  # [num_prefills + 1]
    # Sliding-window attention: each query sees itself and the window - 1 keys before it,
    window: int | None = None
    # and the sequence's first `sinks` keys (attention sinks).
    sinks: int = 0
    # With a window, each prefill's context starts this many positions in: keys before it are out of every query's
    # window (their blocks may already be back in the pool) but for the sinks, which are gathered first.
    # prefill_seq_lens counts the keys gathered.
    prefill_context_starts: list[int] | None = None
    # Each token's sequence (its row of block_tables), built by the first layer that needs it (sparse selection).
    token_rows: torch.Tensor | None = None
    # One metadata per cache group (this one first) when the model's layers have different attention rules.
    groups: list["AttentionMetadata"] | None = None
    # A pooled-entries group (AttentionRule.ratio): slot_mapping holds the slot of each entry this step completes,
    # and this its sources, [entries, span]: the slots of the tokens it pools, in its window group (-1 before the
    # sequence's start), and pooled_starts [entries] the position of each one's first token.
    pooled_sources: torch.Tensor | None = None
    pooled_starts: torch.Tensor | None = None
    # A backend's plan of the step's decode (FlashInfer's planned wrapper, attention/flashinfer_plan.py): made by the
    # first layer that decodes, or for a captured graph kept by the runner and replanned before each replay.
    decode_plan: object | None = None

    def for_group(self, group: int) -> "AttentionMetadata":
        return self if not self.groups else self.groups[group]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def prefill_query_lens(self) -> list[int]:
        return self.query_lens[self.num_decodes :]

    @property
    def prefill_seq_lens(self) -> list[int]:
        """Context length of each prefill as gathered (its sinks, then from its context start, with a window)."""
        lens = self.host_seq_lens[self.num_decodes :]
        if self.prefill_context_starts is None:
            return lens
        return [
            n - start + min(self.sinks, start)
            for n, start in zip(lens, self.prefill_context_starts, strict=True)
        ]

    def prefill_mask(self, j: int, device: torch.device) -> torch.Tensor | None:
        """[query_len, gathered keys] True where query i of prefill j may see each gathered key (bottom-right
        causal, the window and the sinks); None for plain causal attention over the whole context."""
        if self.window is None:
            return None
        n, q_len = self.host_seq_lens[self.num_decodes + j], self.query_lens[self.num_decodes + j]
        start = self.prefill_context_starts[j]
        keys = torch.cat(
            (torch.arange(min(self.sinks, start), device=device), torch.arange(start, n, device=device))
        )
        queries = torch.arange(n - q_len, n, device=device)[:, None]
        return (keys <= queries) & ((keys > queries - self.window) | (keys < self.sinks))


def slot_indices(block_table: torch.Tensor, length: int, block_size: int, start: int = 0) -> torch.Tensor:
    """Flat cache slots of positions start..length-1 of one sequence."""
    pos = torch.arange(start, length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def build_metadata(
    block_size: int,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    slot_mapping: torch.Tensor,
    with_gather_index: bool = True,
    window: int | None = None,
    sinks: int = 0,
) -> AttentionMetadata:
    """with_gather_index=False skips the reference paths' gather indices (a graph-replayed decode needs none).
    window, sinks: the group's sliding window and attention sinks, applied by the gather masks and every backend."""
    device = block_tables.device
    seq_lens_t = queued_values(seq_lens, torch.int32, device)
    meta = AttentionMetadata(
        block_size, slot_mapping, seq_lens_t, block_tables, num_decodes, query_lens, seq_lens, window=window,
        sinks=sinks,
    )  # fmt: skip
    if window is not None:
        meta.prefill_context_starts = [
            max(0, n - q - (window - 1)) for q, n in zip(query_lens[num_decodes:], seq_lens[num_decodes:])
        ]
    if not with_gather_index and num_decodes == len(query_lens):
        return meta
    if num_decodes:
        max_len = max(seq_lens[:num_decodes])
        pos = torch.arange(max_len, device=device)
        tables = block_tables[:num_decodes].long()
        blocks = tables.gather(1, (pos // block_size).expand(num_decodes, -1).clamp(max=tables.shape[1] - 1))
        mask = pos[None, :] < seq_lens_t[:num_decodes, None]
        if window is not None:  # the query at seq_len - 1 sees keys from seq_len - window on, and the sinks
            mask &= (pos[None, :] >= seq_lens_t[:num_decodes, None] - window) | (pos[None, :] < sinks)
        meta.decode_slot_index = torch.where(mask, blocks * block_size + pos % block_size, 0)
        meta.decode_mask = mask
    if num_decodes < len(query_lens):
        starts = meta.prefill_context_starts or [0] * (len(query_lens) - num_decodes)
        parts = []
        for i, start in zip(range(num_decodes, len(query_lens)), starts, strict=True):
            if min(sinks, start):
                parts.append(slot_indices(block_tables[i], min(sinks, start), block_size))
            parts.append(slot_indices(block_tables[i], seq_lens[i], block_size, start))
        meta.prefill_slot_index = torch.cat(parts)
        cu = [[0], [0]]
        for q_len, kv_len in zip(meta.prefill_query_lens, meta.prefill_seq_lens):
            cu[0].append(cu[0][-1] + q_len)
            cu[1].append(cu[1][-1] + kv_len)
        cu_t = queued_values(cu, torch.int32, device)  # one host-to-device copy; rows contiguous
        meta.prefill_cu_query_lens, meta.prefill_cu_seq_lens = cu_t[0], cu_t[1]
    return meta
