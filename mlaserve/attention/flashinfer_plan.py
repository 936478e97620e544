"""One decode step's FlashInfer plan: a planned `BatchMLAPagedAttentionWrapper` (fa3) over the step's page lists.

FlashInfer's `plan` is host work (it schedules the batch's pages over the SMs and copies that schedule to the
device), so it must run before a CUDA graph's replay, never inside the capture; `run` is what a graph captures. An
eager step plans once, when its first layer decodes, and every later layer reuses the plan through the step's
metadata. A captured graph keeps one wrapper with fixed metadata buffers per padded batch size: it is planned at
capture with the static inputs, and the runner replans it with each step's page lists before replaying the graph
(DecodeGraphs.run); FlashInfer copies the new lists into those same buffers, which the captured `run` reads.
"""

from dataclasses import dataclass, field

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.host_copy import queued_tensor

# FlashInfer's float workspace for split-KV partial results; the size its documentation starts from.
WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a plan fixes besides the page lists: every layer of a step must ask for the same."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    scale: float
    dtype: torch.dtype


@dataclass(slots=True)
class FlashInferDecode:
    """A wrapper and what it was planned for. graph_rows > 0: a captured graph's wrapper for that many rows, whose
    metadata buffers stay at fixed addresses (their capacity: every row at its longest table)."""

    graph_rows: int = 0
    graph_max_pages: int = 0
    key: PlanKey | None = None  # None until planned
    declined: bool = False  # the table sent this step (or graph size) to our kernel
    wrapper: object | None = None
    buffers: tuple[torch.Tensor, ...] = field(default_factory=tuple)

    @property
    def planned(self) -> bool:
        return self.key is not None

    def plan(
        self,
        key: PlanKey,
        seq_lens: list[int],
        kv_indices: torch.Tensor,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """Plans the wrapper over one query row per sequence with `seq_lens` cached rows, whose pages are listed
        back to back in kv_indices (int32, host or device). The first plan fixes `key` and takes the workspace."""
        import flashinfer

        if self.wrapper is None:
            self.wrapper = self._new_wrapper(flashinfer, workspace)
        page = key.page_size
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        pages = (lens + page - 1) // page
        kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        qo_indptr = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        # Host tensors, pinned: FlashInfer reads the lengths on the host to schedule (device ones would cost a sync),
        # then copies them to the device, which from pageable memory would wait for the step in flight (host_copy).
        host = [t if t.is_cuda else _pinned(t) for t in (qo_indptr, kv_indptr, kv_indices, lens)]
        metadata = flashinfer.mla.MLAPlanMetadata.csr(*host)
        self.wrapper.plan(
            metadata=metadata, num_heads=key.num_heads, head_dim_ckv=key.kv_lora_rank, head_dim_kpe=key.rope_dim,
            page_size=page, causal=False, sm_scale=key.scale, q_data_type=key.dtype, kv_data_type=key.dtype,
            query_layout="split", kv_cache_layout="packed",
        )  # fmt: skip
        self.key = key

    def _new_wrapper(self, flashinfer: object, workspace: torch.Tensor) -> object:
        if not self.graph_rows:
            return flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
        ints = dict(dtype=torch.int32, device=workspace.device)
        rows = self.graph_rows
        self.buffers = (
            torch.zeros(rows + 1, **ints),
            torch.zeros(rows + 1, **ints),
            torch.zeros(rows * self.graph_max_pages, **ints),
            torch.zeros(rows, **ints),
        )
        return flashinfer.mla.BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, qo_indptr=self.buffers[0], kv_indptr=self.buffers[1],
            kv_indices=self.buffers[2], kv_len_arr=self.buffers[3], backend="fa3",
        )  # fmt: skip

    def replan(self, seq_lens: torch.Tensor, tables: torch.Tensor) -> None:
        """A graph's step: its padded rows' lengths [rows] and block tables [rows, >= pages] on the host, planned
        with the key fixed at capture. Columns past a row's pages hold stale entries, which are left out."""
        lens = seq_lens[: self.graph_rows].tolist()
        pages = (seq_lens[: self.graph_rows] + self.key.page_size - 1) // self.key.page_size
        width = int(pages.max())
        used = torch.arange(width)[None, :] < pages[:, None]
        self.plan(self.key, lens, tables[: self.graph_rows, :width][used].to(torch.int32))

    def run(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """[rows, H, kv_lora_rank] attention output over cache [blocks, page, 1, kv_lora_rank + rope]."""
        packed = cache.view(cache.shape[0], cache.shape[1], cache.shape[-1])
        return self.wrapper.run(query=(_dense(q_latent), _dense(q_pe)), kv_cache=packed)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """Pinning needs a GPU; without one (the CPU tests' stand-in FlashInfer) the plain tensor serves."""
    return t.pin_memory() if torch.cuda.is_available() else t


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def step_page_lists(meta: AttentionMetadata) -> tuple[list[int], torch.Tensor]:
    """An eager step's decode rows: their lengths and their pages back to back, gathered from the device block
    table by indices built on the host (one small copy, no sync)."""
    nd, page = meta.num_decodes, meta.block_size
    lens = meta.host_seq_lens[:nd]
    pages = (torch.tensor(lens) + page - 1) // page
    cols = torch.arange(int(pages.max()))
    flat = (torch.arange(nd)[:, None] * meta.block_tables.shape[1] + cols)[cols < pages[:, None]]
    index = queued_tensor(flat, meta.block_tables.device)
    return lens, meta.block_tables[:nd].reshape(-1).index_select(0, index).to(torch.int32)
