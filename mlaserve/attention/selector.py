"""Picks the attention backend for the hardware, or the one the user asked for, and says why.

attention_backend="flashinfer_mla" (and, once FLASHINFER_BY_DEFAULT is on, any Hopper GPU with FlashInfer
importable) runs our kernels with FlashInfer's fa3 decode in the table where its rule sends a step
(attention/flashinfer_rule.py). Otherwise decode is ours alone."""

import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.flashinfer_mla import FlashInferMLABackend
from mlaserve.attention.flashinfer_rule import FLASHINFER_RULE
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.attention.triton_mla import TritonMLABackend

logger = logging.getLogger(__name__)

# Whether an importable FlashInfer makes flashinfer_mla the CUDA default. Off until tests/gpu/test_flashinfer_backend.py
# and the flashinfer section have run this backend on a GPU; attention_backend="flashinfer_mla" asks for it meanwhile.
FLASHINFER_BY_DEFAULT = False

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchBackend,
    "sdpa": SdpaBackend,
    "triton_mla": TritonMLABackend,
    "flashinfer_mla": FlashInferMLABackend,
}


def select_backend(device: torch.device, requested: str | None = None) -> AttentionBackend:
    return select_backend_and_reason(device, requested)[0]


def select_backend_and_reason(
    device: torch.device, requested: str | None = None
) -> tuple[AttentionBackend, str]:
    """The backend, built, and why it was chosen (logged here; the engine keeps the reason for its report)."""
    name, why = choose_backend(device, requested)
    logger.info("attention backend: %s (%s)", name, why)
    return BACKENDS[name](), why


def attention_kernel(
    backend: AttentionBackend,
    model: object,
    cache_dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    model_dtype: torch.dtype,
) -> str:
    """The decode kernel `backend` runs for `model`, for the start-up log and stats(): for a latent (MLA) cache the
    one the backend picks for the model's heads per rank, latent and rotary widths, cache dtype and page size."""
    own = getattr(model, "attention_kernels", None)
    if own is not None:  # a model that attends itself says what it runs
        return own(backend, cache_dtype, device, model_dtype)
    shape = model.latent_attention_shape()
    if shape is None:  # per-head K/V caches
        return backend.decode_kernel_name
    dense = backend.decode_kernel(*shape, cache_dtype, block_size, device, query_dtype=model_dtype)
    topk = getattr(model, "index_topk", None)
    if topk:  # DeepSeek-V3.2: contexts past top-k take the sparse path
        sparse = backend.sparse_kernels(*shape, cache_dtype, device, query_dtype=model_dtype)
        return f"sparse top-{topk}: {sparse}; contexts up to {topk} tokens: {dense}"
    return dense


def prefill_kernel(
    backend: AttentionBackend, model: object, sinks: int, device: torch.device, model_dtype: torch.dtype
) -> str:
    """The prefill kernel `backend` runs for `model` (its heads per rank, K/V heads and widths; `sinks`: the cache's
    attention sinks, which some kernels cannot take), for the start-up log and stats()."""
    shape = model.prefill_attention_shape()
    if shape is None:
        return "the model's own"
    return backend.prefill_kernel(torch.device(device), model_dtype, *shape, sinks)


def choose_backend(device: torch.device, requested: str | None = None) -> tuple[str, str]:
    """(backend name, why), without building the backend. Raises ValueError for an unknown or unavailable
    requested backend."""
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention_backend {requested!r}; choose one of {sorted(BACKENDS)}")
        reason = BACKENDS[requested].unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend {requested!r} cannot run on {device}: {reason}")
        return requested, "requested by attention_backend option"
    if device.type == "cuda":
        reason = TritonMLABackend.unavailable_reason(device)
        if reason is None:
            hopper = torch.cuda.get_device_capability(device) == (9, 0)
            gluon = (
                ", its split step in Gluon on sm_90: wgmma at 64+ heads, fp8 tensor cores for fp8 caches where they pay"
                if hopper
                else ""
            )
            ours = f"Triton paged MLA decode{gluon}; SDPA prefill and GQA decode"
            missing = FlashInferMLABackend.unavailable_reason(device)
            if missing is None and FLASHINFER_BY_DEFAULT:
                return (
                    "flashinfer_mla",
                    f"CUDA: FlashInfer fa3 MLA decode where {FLASHINFER_RULE}, else {ours}",
                )
            if missing is None:
                missing = (
                    "importable, taken only with attention_backend='flashinfer_mla' until its GPU checks run"
                )
            return "triton_mla", f"CUDA: {ours} (no FlashInfer decode: {missing})"
        return "sdpa", f"CUDA, but triton_mla is unavailable: {reason}"
    return "sdpa", f"{device.type}: fused SDPA prefill, paged torch decode (Triton kernels need a GPU)"
