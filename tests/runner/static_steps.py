"""A CPU stand-in for DecodeGraphs (runner/cuda_graphs.py): what a captured decode or verify step reads, run eagerly.

Each step is staged into static buffers padded to the next of a few sizes (padding rows, stale table columns, as
DecodeGraphs stages them) and runs on the metadata the captured graphs read, every host-side length max_model_len;
with keep_prenorm it returns the hidden states before the final norm, as graphs captured for an MTP drafter do.
Only the capture is missing. The torch reference backend gathers each row's context through indices the kernels do
not need, so those are built here from the staged tables and lengths.
"""

from __future__ import annotations

import bisect

import torch

from mlaserve.attention.metadata import AttentionMetadata, build_metadata
from mlaserve.runner.batch import HostBatch
from mlaserve.runner.cuda_graphs import stage_decode_inputs, static_decode_meta
from mlaserve.runner.queued_verify import correct_rows


class StaticStepsOnCPU:
    def __init__(self, runner, max_model_len: int, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24)) -> None:
        self.runner, self.sizes, self.max_model_len = runner, list(sizes), max_model_len
        self.keep_prenorm = runner.drafter is not None
        largest = self.sizes[-1]
        self.host_i64 = torch.zeros(4, largest, dtype=torch.long)
        self.seq_lens = torch.ones(largest, dtype=torch.int32)
        self.tables = torch.zeros(largest, -(-max_model_len // runner.block_size), dtype=torch.int32)
        self.rows: list[int] = []  # rows of each step run here
        self.sourced = 0  # steps whose input ids came from the step before (lookahead steps)
        self.shifted = 0  # steps queued behind an unread verify step, corrected on the "device"
        self.moved = 0  # rows of those steps moved back (their request's verify step rejected drafts)
        self.prenorm: torch.Tensor | None = (
            None  # the last step's, all its padded rows (an MTP pass reads it)
        )

    def can_run(self, batch: HostBatch) -> bool:
        return batch.num_decodes == len(batch.query_lens) <= self.sizes[-1]

    def run(self, batch: HostBatch, source=None, shift=None) -> torch.Tensor:
        return self._forward(batch, source, shift)[0]

    def run_with_prenorm(
        self, batch: HostBatch, source=None, shift=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keep_prenorm
        return self._forward(batch, source, shift)

    def _forward(self, batch: HostBatch, source=None, shift=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        r, n = self.runner, len(batch.query_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.rows.append(n)
        stage_decode_inputs(batch, size, self.host_i64, self.seq_lens, self.tables)
        if source is not None:  # a lookahead step's input ids, as DecodeGraphs gathers them
            self.host_i64[0, :n] = source[0][torch.tensor(source[1])]
            self.sourced += 1
        if shift is not None:  # as DecodeGraphs corrects a step queued behind an unread verify step
            correct_rows(self.host_i64[1], self.host_i64[2], self.seq_lens, self.tables, shift, r.block_size)
            self.shifted += 1
            self.moved += int((shift != 0).sum())
        slots = self.host_i64[2]
        meta = self.decode_meta(size, slots, self.seq_lens, self.tables)
        inputs = (self.host_i64[0, :size], self.host_i64[1, :size], r.kv_caches, meta)
        if not self.keep_prenorm:
            return r.model.compute_logits(r.model(*inputs))[:n], None
        hidden, self.prenorm = r.model.forward_with_prenorm(*inputs)
        return r.model.compute_logits(hidden)[:n], self.prenorm[:n]

    def step_rows(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """DecodeGraphs.step_rows: the last step's static inputs and hidden states, for an MTP draft pass."""
        slots = self.host_i64[2]
        meta = self.decode_meta(size, slots, self.seq_lens, self.tables)
        return self.host_i64[1, :size], self.tables[:size], meta, self.prenorm

    def decode_meta(
        self, size: int, slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor
    ) -> AttentionMetadata:
        """A captured step's metadata, with the gather indices the torch reference backend reads."""
        r = self.runner
        meta = static_decode_meta(r.block_size, self.max_model_len, r.group_rules, size, slots, seq_lens, tables,
                                  [])  # fmt: skip
        rule = r.group_rules[0]  # a window's gather masks as the kernels mask it
        gather = build_metadata(r.block_size, tables[:size], [1] * size, seq_lens[:size].tolist(), size,
                                slots[:size], window=rule.window, sinks=rule.sinks)  # fmt: skip
        meta.decode_slot_index, meta.decode_mask = gather.decode_slot_index, gather.decode_mask
        return meta
