"""CUDA graphs of short fresh prefills: steps whose sequences all start at position 0, one graph per padded size.

Launched op by op, a 512-token prompt of DeepSeek-V2-Lite is hundreds of kernels and took more host time than
GPU work: a short request spent most of its time to first token waiting for
Python. Replayed from a graph it is one launch.

A step qualifies when it only prefills, every sequence's context is exactly this step's tokens (no prefix-cache hit,
no earlier chunk), it has at most MAX_SEQS sequences and its tokens fit the largest captured size. Those steps read
only the new tokens' slots, so the metadata is a fixed set of buffers: token ids, positions, slots (also the rows the
attention gathers its context from), the sequences' offsets and the rows whose logits are sampled. Padding to the
captured size adds one more sequence holding the padding tokens: they write to slot 0 of the null block (which no
table reads) and attend only among themselves, so every row of the graph stays finite. Offsets past the real
sequences describe empty sequences, which the varlen attention skips.
"""

import bisect
import logging

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.models.base import CausalLM
from mlaserve.runner.batch import HostBatch, stage_token_rows
from mlaserve.runner.cuda_graphs import capture_by_size

logger = logging.getLogger(__name__)

PREFILL_SIZES = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
MAX_SEQS = 8


class PrefillGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = [s for s in PREFILL_SIZES if s <= max_tokens]
        if not self.sizes:
            raise ValueError(
                f"no prefill graph size fits max_tokens={max_tokens} (smallest {PREFILL_SIZES[0]})"
            )
        size, seqs = self.sizes[-1], MAX_SEQS + 1  # + the padding sequence
        # input ids, positions, slots; the offsets and the sampled rows: two copies a step fill them all
        self.dev_i64 = torch.zeros(3, size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev_i64
        self.dev_small = torch.zeros(2, seqs + 1, dtype=torch.long, device=device)
        self.cu_lens = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, 1, dtype=torch.int32, device=device)  # never read by a prefill
        pinned = dict(device="cpu", pin_memory=True)
        self.host_i64 = torch.zeros(3, size, dtype=torch.long, **pinned)
        self.host_small = torch.zeros(2, seqs + 1, dtype=torch.long, **pinned)
        self._copied = torch.cuda.Event()  # behind the last staged copies: the staging rows are free again
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        seqs = MAX_SEQS + 1
        lens = [size] + [0] * MAX_SEQS  # host lengths: only their maximum sizes the attention's grid
        meta = AttentionMetadata(
            self.block_size, self.slot_mapping[:size], self.seq_lens, self.block_tables, 0, lens, list(lens)
        )
        meta.prefill_slot_index = self.slot_mapping[:size]  # the context is this step's tokens
        meta.prefill_cu_query_lens = meta.prefill_cu_seq_lens = self.cu_lens[: seqs + 1]
        return meta

    def _forward(self, size: int) -> torch.Tensor:
        # The offsets are int32 for the attention kernel; copied from the staged int64 row inside the graph.
        self.cu_lens.copy_(self.dev_small[0])
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))
        return self.model.compute_logits(hidden[self.dev_small[1, :MAX_SEQS]])

    def capture(self) -> None:
        self.graphs, self.logits = capture_by_size(self.sizes, self._forward, warm_up=self._stage_empty)
        logger.info(
            "captured CUDA graphs for fresh prefills of up to %d sequences, sizes %s", MAX_SEQS, self.sizes
        )

    def _stage_empty(self, size: int) -> None:
        """Warm-up inputs: one padding sequence of `size` tokens at slot 0."""
        self.dev_i64.zero_()
        self.dev_small.zero_()
        self.dev_small[0, 1:] = size

    def can_run(self, batch: HostBatch) -> bool:
        return (
            batch.num_decodes == 0
            and len(batch.query_lens) <= MAX_SEQS
            and len(batch.ids) <= self.sizes[-1]
            and batch.query_lens == batch.seq_lens  # nothing computed before: fresh prompts
        )

    def run(self, batch: HostBatch) -> torch.Tensor:
        """Logits [num_sampled, vocab] of the batch's sampled sequences, in batch.sample_rows order."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(batch.ids))]
        self._copied.synchronize()
        stage_prefill_inputs(batch, size, self.host_i64, self.host_small)
        # Whole buffers, as the decode graphs copy theirs: a strided slice would be staged through pageable memory.
        # Columns past `size` hold older entries that this graph never reads.
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_small.copy_(self.host_small, non_blocking=True)
        self._copied.record()
        self.graphs[size].replay()
        return self.logits[size][: len(batch.sample_rows)]


def stage_prefill_inputs(
    batch: HostBatch, size: int, host_i64: torch.Tensor, host_small: torch.Tensor
) -> None:
    """Writes a fresh-prefill batch padded to `size` tokens into the staging tensors: host_i64 [3, >= size] (input
    ids, positions, slots), host_small [2, MAX_SEQS + 2] (sequence offsets; the sampled sequences' last-token rows).

    Padding tokens are position 0 at slot 0 of the null block, as one extra sequence; offsets past it repeat the
    total (empty sequences). The staging tensors are pinned memory that asynchronous copies read: PrefillGraphs.run
    waits for the previous step's copies before calling this."""
    stage_token_rows(batch, size, host_i64)
    offsets = [0]
    for length in batch.query_lens:
        offsets.append(offsets[-1] + length)
    offsets += [size] * (host_small.shape[1] - len(offsets))  # the padding sequence, then empty ones
    host_small[0] = torch.tensor(offsets)
    rows = batch.sample_rows + [0] * (host_small.shape[1] - len(batch.sample_rows))
    host_small[1] = torch.tensor(rows)
