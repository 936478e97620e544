"""RMSNorm, computed in float32 as the reference models do, so fp32 runs match them bit for bit on the CPU.

On CUDA a fused Triton kernel (triton_norm.py) replaces the handful of eager kernels, and can fold in the residual
add that precedes the norm; `rms_norm_reference` is the torch definition it is tested against and the CPU path.
The kernel differs from it only in the fp32 summation order (about 1e-6 relative in fp32).
"""

import functools
from collections.abc import Callable

import torch
from torch import nn

# The kernel normalises in fp32; wider inputs (fp64) keep the torch path so their residual add stays exact.
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@functools.cache
def _triton_rms_norm() -> Callable | None:
    # Imported on first CUDA use only: CPU runs never pay for (or need) triton.
    try:
        from mlaserve.layers.triton_norm import rms_norm
    except ImportError:
        return None
    return rms_norm


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in _TRITON_DTYPES
        and weight.dtype in _TRITON_DTYPES
        and _triton_rms_norm() is not None
    )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x, self.weight):
            return _triton_rms_norm()(x, self.weight, self.eps)[0]
        return rms_norm_reference(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): on CUDA one kernel instead of the add plus the norm's kernels."""
        if _use_triton(x, self.weight) and residual.dtype == x.dtype and residual.shape == x.shape:
            return _triton_rms_norm()(x, self.weight, self.eps, residual)
        h = x + residual
        return self(h), h
