"""Where a twin test runs its kernels: on the GPU when there is one and Triton compiles for it, else on the CPU
under Triton's interpreter. One test body serves both; its sizes and dtypes follow the device."""

import os

import torch


def kernel_test_device() -> str:
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return "cuda" if torch.cuda.is_available() and not interpreting else "cpu"


def on_gpu() -> bool:
    return kernel_test_device() == "cuda"


def kernel_test_dtypes() -> list[torch.dtype]:
    """The interpreter's tl.dot reads bf16 operands wrongly, so CPU runs take float32 and fp16 only."""
    if on_gpu():
        return [torch.float32, torch.bfloat16, torch.float16]
    return [torch.float32, torch.float16]
