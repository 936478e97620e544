"""Picks the attention backend for the hardware, or the one the user asked for, and says why."""

import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.attention.triton_mla import TritonMLABackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchBackend,
    "sdpa": SdpaBackend,
    "triton_mla": TritonMLABackend,
}


def select_backend(device: torch.device, requested: str | None = None) -> AttentionBackend:
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention_backend {requested!r}; choose one of {sorted(BACKENDS)}")
        reason = BACKENDS[requested].unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend {requested!r} cannot run on {device}: {reason}")
        logger.info("attention backend: %s (requested by attention_backend option)", requested)
        return BACKENDS[requested]()
    if device.type == "cuda":
        reason = TritonMLABackend.unavailable_reason(device)
        if reason is None:
            hopper = torch.cuda.get_device_capability(device) == (9, 0)
            logger.info(
                "attention backend: triton_mla (CUDA: Triton paged MLA decode%s; SDPA prefill and GQA decode)",
                ", its split step in Gluon on sm_90: wgmma at 64+ heads, fp8 tensor cores for fp8 caches where they pay"
                if hopper
                else "",
            )
            return TritonMLABackend()
        why = f"CUDA, but triton_mla is unavailable: {reason}"
    else:
        why = f"{device.type}: fused SDPA prefill, paged torch decode (Triton kernels need a GPU)"
    logger.info("attention backend: sdpa (%s)", why)
    return SdpaBackend()
