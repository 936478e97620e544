"""GPU backend with FlashInfer in the decode table: absorbed MLA decode runs on FlashInfer's fa3 wrapper where the
table rule sends a step (flashinfer_rule.py), on our kernels everywhere else; prefill, GQA, sparse and the 8-bit
caches are the triton_mla backend's. Needs `flashinfer` importable (`pip install mlaserve[flashinfer]`) and Hopper.

A step's plan lives in its metadata (`AttentionMetadata.decode_plan`): the first layer that decodes makes it, the
others reuse it; a captured graph's plan is made once per padded batch size and replanned by the runner before each
replay (flashinfer_plan.py says why).
"""

from collections import deque

import torch

from mlaserve.attention.flashinfer_plan import WORKSPACE_BYTES, FlashInferDecode, PlanKey, step_page_lists
from mlaserve.attention.flashinfer_rule import (
    decode_policy,
    describe_choice,
    flashinfer_pays,
    flashinfer_refusal,
)
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.triton_mla import TritonMLABackend
from mlaserve.kernels.mla_decode.rules import DecodeShape

# Eager plans kept alive: two steps' (the one running and the one queued behind it), with room for a second
# unwindowed cache group per step.
KEPT_PLANS = 4


def flashinfer_missing() -> str | None:
    """None when flashinfer imports, else why not."""
    try:
        import flashinfer.mla  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:  # absent, or its native libraries fail to load
        return f"flashinfer is not importable ({error}); pip install mlaserve[flashinfer]"
    return None


class FlashInferMLABackend(TritonMLABackend):
    name = "flashinfer_mla"

    def __init__(self) -> None:
        self.policy = decode_policy()
        # FlashInfer's float workspace, made on the first plan and shared by every plan: their runs are ordered on
        # one stream
        self._workspace: torch.Tensor | None = None
        # Eager steps' plans, kept past their steps: FlashInfer copies each plan's schedule to the device from a
        # pinned buffer the wrapper holds, and a wrapper dropped with its step's metadata would hand that buffer back
        # while the copy may still wait behind the step before (asynchronous scheduling runs one step ahead), for the
        # next step's plan to overwrite.
        self._recent: deque[FlashInferDecode] = deque(maxlen=KEPT_PLANS)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        reason = super().unavailable_reason(device) or flashinfer_missing()
        if reason is None and (device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0)):
            reason = "FlashInfer's fa3 MLA decode needs an sm_90 (Hopper) GPU"
        return reason

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
        ours = self.table_kernel(
            num_heads, kv_lora_rank, rope_dim, cache_dtype, block_size, device, query_dtype
        )
        shape = DecodeShape(
            num_heads, kv_lora_rank, rope_dim, cache_dtype, query_dtype or cache_dtype, block_size
        )
        return describe_choice(shape, ours, self.policy)

    def graph_decode_plan(self, rows: int, max_pages: int) -> FlashInferDecode | None:
        return FlashInferDecode(graph_rows=rows, graph_max_pages=max_pages)

    def decode_latent(self, q_latent, q_pe, cache, meta: AttentionMetadata, scale: float, kv_lora_rank: int):
        plan = self._step_plan(q_latent, q_pe, cache, meta, scale)
        if plan is None:
            return super().decode_latent(q_latent, q_pe, cache, meta, scale, kv_lora_rank)
        return plan.run(q_latent, q_pe, cache)

    def _step_plan(
        self, q_latent, q_pe, cache, meta: AttentionMetadata, scale: float
    ) -> FlashInferDecode | None:
        """The step's plan where the table sends it to FlashInfer (made here by the step's first decoding layer),
        else None."""
        plan = meta.decode_plan
        if plan is None:  # an eager step's first decoding layer
            plan = meta.decode_plan = FlashInferDecode()
        if plan.declined:
            return None
        key = PlanKey(
            q_latent.shape[1], q_latent.shape[-1], q_pe.shape[-1], cache.shape[1], scale, q_latent.dtype
        )
        if plan.planned:  # a layer unlike the first (none in the models served) keeps our kernel
            return plan if plan.key == key else None
        shape = DecodeShape(
            key.num_heads, key.kv_lora_rank, key.rope_dim, cache.dtype, key.dtype, key.page_size
        )
        # A window or sinks (the training-free long-context options) mask keys, which FlashInfer's decode cannot;
        # its packed cache view needs one latent row per token, as MLA caches hold.
        packed = (
            cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == key.kv_lora_rank + key.rope_dim
        )
        if (
            meta.window is not None
            or not packed
            or flashinfer_refusal(shape) is not None
            or not flashinfer_pays(meta.num_decodes, self.policy)
        ):
            plan.declined = True
            return None
        lens, kv_indices = step_page_lists(meta)
        plan.plan(key, lens, kv_indices, self._workspace_on(q_latent.device))
        if not plan.graph_rows:  # a graph's plan lives with the runner, and is replanned in place
            self._recent.append(plan)
        return plan

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace
