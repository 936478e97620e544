"""Picks the attention backend for the hardware, or the one the user asked for, and says why."""

import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.attention.torch_ref import TorchBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "sdpa": SdpaBackend}


def select_backend(device: torch.device, requested: str | None = None) -> AttentionBackend:
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention_backend {requested!r}; choose one of {sorted(BACKENDS)}")
        reason = BACKENDS[requested].unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend {requested!r} cannot run on {device}: {reason}")
        logger.info("attention backend: %s (requested by attention_backend option)", requested)
        return BACKENDS[requested]()
    chosen = SdpaBackend
    why = f"fused SDPA prefill, paged torch decode; the best available on {device.type}"
    logger.info("attention backend: %s (%s)", chosen.name, why)
    return chosen()
