"""The table rule that says when absorbed MLA decode runs on FlashInfer's fa3 wrapper instead of our kernels.

Plain Python over the decode shape (no flashinfer, no triton import), so the selector can name the choice on any
machine. Two parts: what FlashInfer takes at all (`flashinfer_refusal`), and where it was measured faster than ours
(`flashinfer_pays`).

Where it pays comes from issue 46's side-by-side table (CUDA-graph replays on the H200, bf16, pages of 64): fa3 led
at every measured batch of 32 or more, at 16 heads and by more at 128 heads, and ours led at batch 1 at both head
counts. No batch between 1 and 32 was measured, so ours keeps them until the GPU suite's `flashinfer` section (its
batch sweep) shows where the crossing lies. A CUDA graph is captured per padded batch size, so the rule reads the
batch alone: a graph's context is only known at replay.
"""

import os

import torch

from mlaserve.kernels.mla_decode.rules import DecodeShape

# The smallest decode batch FlashInfer takes under the rule (the smallest measured batch where it led).
FLASHINFER_MIN_BATCH = 32
FLASHINFER_RULE = f"batch >= {FLASHINFER_MIN_BATCH}"
# fa3's PV product is a wgmma of half the latent width, built for these widths; its rope part is whole 64-wide tiles.
FA3_LATENT_RANKS = (128, 256, 512)
FA3_ROPE_MULTIPLE = 64
# The query and cache dtypes it is run with here: FlashInfer's fp8 cache takes per-tensor (or per-128-column)
# scales in a separate tensor, while our 8-bit rows carry their scale in each row's tail (kvcache/quant.py), so it
# cannot read our 8-bit caches; and it has no float32 kernels.
FA3_DTYPES = (torch.bfloat16, torch.float16)

# Forces the choice for benchmarks: "rule" (the default), "always" (every shape FlashInfer takes) or "never" (ours).
DECODE_ENV = "MLASERVE_FLASHINFER_DECODE"
POLICIES = ("rule", "always", "never")


def decode_policy() -> str:
    """MLASERVE_FLASHINFER_DECODE, checked: read once when the backend is built, never per call."""
    policy = os.environ.get(DECODE_ENV, "rule")
    if policy not in POLICIES:
        raise ValueError(f"{DECODE_ENV}={policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


def flashinfer_refusal(shape: DecodeShape) -> str | None:
    """None where FlashInfer's fa3 MLA decode can run `shape` on our cache, else why not."""
    if shape.cache_dtype not in FA3_DTYPES:
        return f"takes bfloat16 and float16 caches, not {str(shape.cache_dtype).removeprefix('torch.')}"
    if shape.query_dtype != shape.cache_dtype:
        return "takes a query of the cache's dtype"
    if shape.kv_lora_rank not in FA3_LATENT_RANKS:
        return f"takes latent ranks {FA3_LATENT_RANKS}, not {shape.kv_lora_rank}"
    if shape.rope_dim <= 0 or shape.rope_dim % FA3_ROPE_MULTIPLE:
        return f"takes rotary widths that are multiples of {FA3_ROPE_MULTIPLE}, not {shape.rope_dim}"
    return None


def flashinfer_pays(batch: int, policy: str = "rule") -> bool:
    """Whether a decode step of `batch` sequences (a graph's padded size) goes to FlashInfer, for a shape it takes."""
    if policy == "never":
        return False
    return policy == "always" or batch >= FLASHINFER_MIN_BATCH


def describe_choice(shape: DecodeShape, ours: str, policy: str = "rule") -> str:
    """The decode kernel named in the start-up log and stats(): FlashInfer where the rule sends a step, else ours."""
    why = flashinfer_refusal(shape)
    if why is not None:
        return f"{ours} (flashinfer fa3 {why})"
    if policy == "never":
        return f"{ours} ({DECODE_ENV}=never)"
    if policy == "always":
        return f"flashinfer fa3 ({DECODE_ENV}=always)"
    return f"flashinfer fa3 where {FLASHINFER_RULE}, else {ours}"
