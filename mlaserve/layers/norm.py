"""RMSNorm, computed in float32 as the reference models do, so fp32 runs match them bit for bit on the CPU.

On CUDA a fused Triton kernel (kernels/norm.py) replaces the handful of eager kernels, and can fold in the residual
add that precedes the norm; `rms_norm_reference` is the torch definition it is tested against and the CPU path.
The kernel differs from it only in the fp32 summation order (about 1e-6 relative in fp32).
"""

import torch
from torch import nn

from mlaserve.kernels.registry import RMS_NORM


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = RMS_NORM.choose(x, self.weight, self.eps)
        if kernel is not None:
            return kernel(x, self.weight, self.eps)[0]
        return rms_norm_reference(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): on CUDA one kernel instead of the add plus the norm's kernels."""
        kernel = RMS_NORM.choose(x, self.weight, self.eps, residual)
        if kernel is not None:
            return kernel(x, self.weight, self.eps, residual)
        h = x + residual
        return self(h), h


class Float32RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32 and multiplies in float32, cast once at the end (DeepSeek-V4 keeps its
    norm weights in float32); torch only, for the V4 reference path."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
