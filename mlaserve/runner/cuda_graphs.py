"""CUDA graphs of the decode step (embedding to logits), one per padded batch size.

A decode step of a big MoE model is hundreds of small kernels; replaying a captured graph removes their launch
and Python cost. Graphs need fixed shapes and addresses, so inputs are copied into static buffers, the batch is
padded to the next captured size (padding rows write to slot 0 of the null block, which no table reads), and
the attention kernel sizes its KV splits from max_model_len instead of the step's longest sequence.
Only backends that declare `supports_cuda_graphs` (no data-dependent shapes in decode) are captured, and models whose
layers attend on their own without host-dependent shapes in decode (DeepSeek-V4). A model with several cache groups
gets static tables and slots for each; a pooled-entries group (AttentionRule.ratio) gets each row's entry, written by
every row and kept where the row completes it (a row that does not writes to slot 0 of the null block).
Speculative verify steps replay the same graphs, one decode row per token (runner/verify_graphs.py): an engine that
drafts k tokens captures up to max_num_seqs x (k + 1) rows, and an MTP engine's graphs also keep every row's hidden
state before the final norm, which its draft layer's pass reads (runner/mtp_graphs.py, on these static inputs).
"""

import bisect
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.host_copy import copy_queued
from mlaserve.kvcache.spec import FULL, AttentionRule
from mlaserve.models.base import CausalLM
from mlaserve.runner.batch import HostBatch, entry_rows, stage_token_rows
from mlaserve.runner.queued_verify import correct_rows

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

Output = TypeVar("Output")


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        rules: list[AttentionRule] | None = None,
        backend: AttentionBackend | None = None,
        rows_per_seq: int = 1,
        keep_prenorm: bool = False,
    ) -> None:
        """rows_per_seq: 1 + the drafts a sequence may carry (a verify step's rows); keep_prenorm: the graphs also
        return the hidden states before the final norm (an MTP drafter reads them)."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len = max_model_len
        self.rules = rules or [FULL]
        rows = max_num_seqs * rows_per_seq
        self.sizes = capture_sizes(rows)
        self.keep_prenorm = keep_prenorm
        size, blocks = self.sizes[-1], -(-max_model_len // block_size)
        # input ids, positions, slots and (lookahead steps) each row's index into the previous step's sampled
        # tokens, as rows of one buffer: one copy a step fills all four
        self.dev_i64 = torch.zeros(4, size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.source_rows = self.dev_i64
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, blocks, dtype=torch.int32, device=device)
        # Pinned staging rows (the i64 rows above; sequence lengths; block tables): a step's inputs go from here
        # into the static buffers as three asynchronous copies. Going through pageable device tensors cost six
        # blocking host-to-device copies plus five device copies per step. Two sets in turn: with asynchronous
        # scheduling the next step is staged while this one may not have been copied yet. Before a set is
        # rewritten, the event recorded behind its last copies is waited for: normally that step has been collected
        # long before, but a lookahead step the engine dropped unread (all its requests stopped) never is.
        pinned = dict(device="cpu", pin_memory=True)
        self.staging = [
            (
                torch.zeros(4, size, dtype=torch.long, **pinned),
                torch.ones(size, dtype=torch.int32, **pinned),
                torch.zeros(size, blocks, dtype=torch.int32, **pinned),
            )
            for _ in range(2)
        ]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self.group_inputs = allocate_group_inputs(self.rules, size, max_model_len, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # A backend that plans its decode on the host (FlashInfer) keeps one plan per graph, replanned before replay.
        self.decode_plans = {s: backend.graph_decode_plan(s, blocks) for s in self.sizes} if backend else {}
        self.prenorm: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        meta = static_decode_meta(
            self.block_size, self.max_model_len, self.rules, size, self.slot_mapping, self.seq_lens,
            self.block_tables, self.group_inputs,
        )  # fmt: skip
        meta.decode_plan = self.decode_plans.get(size)
        return meta

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))
        if not self.keep_prenorm:
            return self.model.compute_logits(self.model(*inputs)), None
        hidden, prenorm = self.model.forward_with_prenorm(*inputs)
        return self.model.compute_logits(hidden), prenorm

    def capture(self) -> None:
        self.graphs, outputs = capture_by_size(self.sizes, self._forward)
        self.logits = {size: logits for size, (logits, _) in outputs.items()}
        self.prenorm = {size: prenorm for size, (_, prenorm) in outputs.items() if prenorm is not None}
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, batch: HostBatch) -> bool:
        num_seqs = len(batch.query_lens)
        fits = num_seqs <= self.sizes[-1] and max(batch.seq_lens, default=0) <= self.max_model_len
        return batch.num_decodes == num_seqs and fits

    def run(
        self,
        batch: HostBatch,
        source: tuple[torch.Tensor, list[int]] | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only batch. source: for a lookahead step, the previous step's
        sampled token ids on the device and, per row, the index of the row's input token among them. shift: for a
        step queued behind an unread verify step, each row's move back (queued_verify.correct_rows)."""
        return self.logits[self._replay(batch, source, shift)][: len(batch.query_lens)]

    def run_with_prenorm(
        self,
        batch: HostBatch,
        source: tuple[torch.Tensor, list[int]] | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states before the final norm), one row each per sequence of a decode-only batch, from
        graphs captured with keep_prenorm. Both are the graph's buffers: read them before the next replay. source,
        shift: as run's."""
        size, n = self._replay(batch, source, shift), len(batch.query_lens)
        return self.logits[size][:n], self.prenorm[size][:n]

    def step_rows(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(positions, block tables, metadata, hidden states before the final norm) of the graph of `size` rows:
        its static inputs and output, which a captured MTP draft pass reads (runner/mtp_graphs.py)."""
        return self.positions[:size], self.block_tables[:size], self._meta(size), self.prenorm[size]

    def decode_meta(
        self, size: int, slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor
    ) -> AttentionMetadata:
        """The metadata of a decode batch of `size` rows on other static inputs (an MTP pass's chained rows)."""
        rules, length = self.rules, self.max_model_len
        return static_decode_meta(self.block_size, length, rules, size, slots, seq_lens, tables, [])

    def _replay(
        self, batch: HostBatch, source: tuple[torch.Tensor, list[int]] | None, shift: torch.Tensor | None
    ) -> int:
        """Stages the batch into the static inputs and replays the graph of its padded size, which it returns."""
        n = len(batch.query_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._turn ^= 1
        host_i64, host_seq_lens, host_tables = self.staging[self._turn]
        self._copied[self._turn].synchronize()
        stage_decode_inputs(batch, size, host_i64, host_seq_lens, host_tables)
        if source is not None:
            host_i64[3, :n] = torch.tensor(source[1])
        # Each copy is one contiguous block (a strided one would be staged through pageable memory): the small
        # buffers whole, the tables' first `size` rows whole. What lies past the batch is older entries that this
        # graph never reads (rows past `size`, table columns past each sequence's length).
        self.dev_i64.copy_(host_i64, non_blocking=True)
        self.seq_lens.copy_(host_seq_lens, non_blocking=True)
        self.block_tables[:size].copy_(host_tables[:size], non_blocking=True)
        copy_group_inputs(
            self.group_inputs, stage_group_inputs(batch, size, self.rules, self.block_size), size
        )
        self._copied[self._turn].record()
        if source is not None:
            torch.index_select(source[0], 0, self.source_rows[:n], out=self.input_ids[:n])
        if shift is not None:  # positions and lengths the host planned before the accepted drafts were known
            correct_rows(
                self.positions, self.slot_mapping, self.seq_lens, self.block_tables, shift, self.block_size
            )
        plan = self.decode_plans.get(size)
        if plan is not None and plan.planned:
            plan.replan(host_seq_lens, host_tables)
        self.graphs[size].replay()
        return size


def capture_sizes(rows: int) -> list[int]:
    """The captured batch sizes for steps of up to `rows` rows: CAPTURE_SIZES below it, then `rows` itself, at most
    the largest of CAPTURE_SIZES (larger steps run eagerly)."""
    return [s for s in CAPTURE_SIZES if s < min(rows, CAPTURE_SIZES[-1])] + [min(rows, CAPTURE_SIZES[-1])]


@torch.inference_mode()
def capture_by_size(
    sizes: list[int], forward: Callable[[int], Output], warm_up: Callable[[int], None] | None = None
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Output]]:
    """One graph of forward(size) per size, sharing one memory pool, and each graph's output tensor.

    Every size runs once first, off the default stream as torch's graph docs ask (Triton compiles happen there);
    warm_up(size) sets the static inputs before that run. Captured largest first, so smaller graphs reuse the
    largest one's memory."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in sizes:
            if warm_up is not None:
                warm_up(size)
            forward(size)
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outputs = {}, {}
    for size in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def stage_decode_inputs(
    batch: HostBatch, size: int, host_i64: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor
) -> None:
    """Writes a decode batch padded to `size` rows into the staging tensors: host_i64 [>= 3, >= size] (input ids,
    positions, slots), seq_lens [>= size], tables [>= size, blocks]. Padding rows are one token at slot 0 of the
    null block; table columns past the batch's widest table keep older entries, which no kernel reads."""
    n = len(batch.query_lens)
    width = batch.tables.shape[1]
    stage_token_rows(batch, size, host_i64)
    seq_lens[:n] = torch.tensor(batch.seq_lens, dtype=torch.int32)
    tables[:n, :width] = batch.tables
    if size > n:
        seq_lens[n:size] = 1
        tables[n:size] = 0


def allocate_group_inputs(
    rules: list[AttentionRule], size: int, max_model_len: int, block_size: int, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """Static inputs of each cache group past the first: (tables, slots), and a pooled group's (entry sources,
    entry starts) too (stage_group_inputs says what they hold)."""
    group_inputs = []
    for rule in rules[1:]:
        blocks = -(-max_model_len // (block_size * (rule.ratio or 1)))
        inputs = (
            torch.zeros(size, blocks, dtype=torch.int32, device=device),
            torch.zeros(size, dtype=torch.long, device=device),
        )
        if rule.ratio:
            inputs += (
                torch.zeros(size, rule.source_span, dtype=torch.long, device=device),
                torch.zeros(size, dtype=torch.long, device=device),
            )
        group_inputs.append(inputs)
    return group_inputs


def copy_group_inputs(
    group_inputs: list[tuple[torch.Tensor, ...]], staged: list[tuple[torch.Tensor, ...]], size: int
) -> None:
    """stage_group_inputs' host tensors into the static ones, queued behind the step in flight (host_copy)."""
    for static, host_inputs in zip(group_inputs, staged, strict=True):
        for dev, host in zip(static, host_inputs, strict=True):
            copy_queued(dev[:size, : host.shape[1]] if host.dim() == 2 else dev[:size], host)


def static_decode_meta(
    block_size: int,
    max_model_len: int,
    rules: list[AttentionRule],
    size: int,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    group_inputs: list[tuple[torch.Tensor, ...]],
) -> AttentionMetadata:
    """The metadata a captured decode step of `size` rows reads: views of the static inputs, every host-side length
    max_model_len (fixed KV split sizes and gather widths, whatever the step's lengths), one per cache group."""
    fixed = dict(num_decodes=size, query_lens=[1] * size, host_seq_lens=[max_model_len] * size)
    meta = AttentionMetadata(
        block_size, slot_mapping[:size], seq_lens[:size], block_tables[:size], window=rules[0].window,
        sinks=rules[0].sinks, **fixed,
    )  # fmt: skip
    if group_inputs:
        meta.groups = [meta]
        for rule, (tables, slots, *entries) in zip(rules[1:], group_inputs, strict=True):
            group = AttentionMetadata(
                block_size, slots[:size], seq_lens[:size], tables[:size], window=rule.window, sinks=rule.sinks,
                **fixed,
            )  # fmt: skip
            if entries:
                group.pooled_sources, group.pooled_starts = entries[0][:size], entries[1][:size]
            meta.groups.append(group)
    return meta


def stage_group_inputs(
    batch: HostBatch, size: int, rules: list[AttentionRule], block_size: int
) -> list[tuple[torch.Tensor, ...]]:
    """The decode batch's inputs of each cache group past the first, padded to `size` rows: (tables, slots) and, for
    a pooled group, each row's entry (slot, window-group sources, start) with its slot 0 of the null block where the
    row does not complete it. Padding rows have zero tables, slot 0 and no sources (-1)."""
    n = len(batch.query_lens)
    groups = [(batch.tables, batch.slots), *batch.other_groups]
    staged = []
    for g, rule in enumerate(rules[1:], start=1):
        tables, slots = groups[g]
        padded = torch.zeros(size, tables.shape[1], dtype=torch.int32)
        padded[:n] = tables
        row_slots = torch.zeros(size, dtype=torch.long)
        if rule.ratio is None:
            row_slots[:n] = slots
            staged.append((padded, row_slots))
            continue
        window_tables = groups[rules.index(rule.source_rule)][0]
        done, entry_slots, sources, starts = entry_rows(
            tables, window_tables, torch.arange(n), batch.positions, block_size, rule.ratio, rule.source_span
        )
        row_slots[:n] = torch.where(done, entry_slots, 0)
        row_sources = torch.full((size, sources.shape[1]), -1, dtype=torch.long)
        row_sources[:n] = sources
        row_starts = torch.zeros(size, dtype=torch.long)
        row_starts[:n] = starts
        staged.append((padded, row_slots, row_sources, row_starts))
    return staged
