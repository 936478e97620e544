"""GPU backend: paged MLA decode by the kernel the dispatch table picks for the shape (triton/dispatch.py); SDPA
for prefill and for GQA decode."""

import os

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.host_copy import queued_values
from mlaserve.kvcache.quant import is_quantized


class TritonMLABackend(SdpaBackend):
    name = "triton_mla"
    supports_cuda_graphs = True  # for latent caches; GQA decode goes through SDPA and is not captured
    paged_kernels = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "it needs a CUDA GPU (or TRITON_INTERPRET=1, the slow CPU interpreter used by tests)"
        return None

    def decode_kernel(
        self,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        cache_dtype: torch.dtype,
        block_size: int,
        device: torch.device,
        query_dtype: torch.dtype | None = None,
    ) -> str:
        return self.table_kernel(
            num_heads, kv_lora_rank, rope_dim, cache_dtype, block_size, device, query_dtype
        )

    @staticmethod
    def table_kernel(
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        cache_dtype: torch.dtype,
        block_size: int,
        device: torch.device,
        query_dtype: torch.dtype | None = None,
    ) -> str:
        """The kernel our own table (kernels/mla_decode/dispatch.py) picks for the shape: what sparse attention runs
        whichever backend subclasses this one."""
        from mlaserve.kernels.mla_decode.dispatch import decode_device, describe
        from mlaserve.kernels.mla_decode.rules import DecodeShape

        if query_dtype is None:
            query_dtype = torch.bfloat16 if is_quantized(cache_dtype) else cache_dtype
        shape = DecodeShape(num_heads, kv_lora_rank, rope_dim, cache_dtype, query_dtype, block_size)
        return describe(shape, decode_device(torch.device(device)))

    def decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, v_dim: int, need_lse: bool = False
    ):
        if v_cache is not None:  # per-head K/V (GQA models): the SDPA path
            return super().decode(q, k_cache, v_cache, meta, scale, v_dim, need_lse)
        return self._mla_decode(q, None, k_cache, meta, scale, v_dim)

    def decode_latent(self, q_latent, q_pe, cache, meta: AttentionMetadata, scale: float, kv_lora_rank: int):
        # the kernel reads both parts in place
        return self._mla_decode(q_latent, q_pe, cache, meta, scale, kv_lora_rank)[0]

    @staticmethod
    def _mla_decode(q, q_pe, cache, meta: AttentionMetadata, scale: float, kv_lora_rank: int):
        from mlaserve.kernels.mla_decode.decode import mla_decode

        nd = meta.num_decodes
        max_len = max(meta.host_seq_lens[:nd])
        return mla_decode(
            q, cache, meta.block_tables[:nd], meta.seq_lens[:nd], max_len, kv_lora_rank, scale, q_pe=q_pe
        )

    def sparse_kernels(self, num_heads, kv_lora_rank, rope_dim, cache_dtype, device, query_dtype=None) -> str:
        attend = self.table_kernel(num_heads, kv_lora_rank, rope_dim, cache_dtype, 1, device, query_dtype)
        return f"triton index scores + torch.topk, then {attend} over the selected rows"

    def select_topk(self, q, weights, key_cache, meta: AttentionMetadata, positions, topk: int, scale: float):
        from mlaserve.kernels.index_topk import select_topk_paged

        if meta.token_rows is None:  # each token's sequence (its block-table row), once per step
            rows = torch.arange(len(meta.query_lens), device=q.device)
            if meta.num_decodes < len(
                meta.query_lens
            ):  # (a decode step's is the arange: no host copy to capture)
                repeats = queued_values(meta.query_lens, torch.long, q.device)
                # output_size given: torch need not read the repeats back from the device to size the result
                rows = torch.repeat_interleave(rows, repeats, output_size=sum(meta.query_lens))
            meta.token_rows = rows
        visible = (positions + 1).to(torch.int32)  # causal: a token sees keys up to its own position
        return select_topk_paged(
            q,
            weights,
            key_cache,
            meta.block_tables,
            meta.token_rows,
            visible,
            max(meta.host_seq_lens),
            topk,
            scale,
        )

    def sparse_latent(self, q_latent, q_pe, cache, slots, scale: float, kv_lora_rank: int):
        """The paged decode kernels with pages of one row: each token's selected slots are its "block table" (the
        valid ones come first, the -1s last: index_topk.slots_of_positions), their count its length."""
        from mlaserve.kernels.mla_decode.decode import mla_decode

        rows = cache.view(-1, 1, 1, cache.shape[-1])
        lens = (slots >= 0).sum(dim=1, dtype=torch.int32)
        table = slots.clamp(min=0).to(torch.int32)
        return mla_decode(q_latent, rows, table, lens, slots.shape[1], kv_lora_rank, scale, q_pe=q_pe)[0]
