"""GPU backend: the Triton paged MLA decode kernel for latent caches; SDPA for prefill and for GQA decode."""

import os

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.sdpa import SdpaBackend


class TritonMLABackend(SdpaBackend):
    name = "triton_mla"
    supports_cuda_graphs = True  # for latent caches; GQA decode goes through SDPA and is not captured

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "it needs a CUDA GPU (or TRITON_INTERPRET=1, the slow CPU interpreter used by tests)"
        return None

    def decode(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        need_lse: bool = False,
        q_pe=None,
    ):
        if v_cache is not None:  # per-head K/V (GQA models): the SDPA path
            return super().decode(q, k_cache, v_cache, meta, scale, v_dim, need_lse, q_pe)
        from mlaserve.attention.triton.mla_decode import mla_decode

        nd = meta.num_decodes
        max_len = max(meta.host_seq_lens[:nd])
        return mla_decode(
            q, k_cache, meta.block_tables[:nd], meta.seq_lens[:nd], max_len, v_dim, scale, q_pe=q_pe
        )
