"""act(gate) * up for the experts' gate_up rows (gate columns, then up) where no GEMM epilogue fuses it."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mlaserve.kernels.registry import SILU_AND_MUL


def act_and_mul(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(gate) * up, contiguous for the next GEMM."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (act(gate) * up).contiguous()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: one launch on CUDA (act.py), torch elsewhere."""
    kernel = SILU_AND_MUL.choose(gate_up)
    return kernel(gate_up) if kernel is not None else act_and_mul(gate_up, F.silu)
