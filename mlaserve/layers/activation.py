"""Gated MLP activations: the gate and up projections arrive concatenated from one GEMM."""

import torch
import torch.nn.functional as F

from mlaserve.kernels.registry import SILU_AND_MUL

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act_fn(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def gated_act(gate_up: torch.Tensor, act_name: str = "silu") -> torch.Tensor:
    if act_name == "silu":
        kernel = SILU_AND_MUL.choose(gate_up)
        if kernel is not None:  # CUDA: one launch
            return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return get_act_fn(act_name)(gate) * up
