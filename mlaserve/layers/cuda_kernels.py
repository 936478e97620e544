"""Which layers take their fused Triton kernel: CUDA tensors in a dtype the kernels widen to fp32 from.

Each kernel module is imported on first CUDA use only, so CPU runs never pay for (or need) triton; the torch code
beside each layer stays its CPU path and reference. Wider inputs (fp64) keep the torch path too.
"""

import functools
import importlib
from collections.abc import Callable

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _load(module: str, name: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def kernel_for(module: str, name: str, *tensors: torch.Tensor) -> Callable | None:
    """`module.name` when every tensor is on CUDA in a kernel dtype and triton imports; None otherwise."""
    if all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors):
        return _load(module, name)
    return None
