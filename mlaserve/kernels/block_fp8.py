"""Linear layers over block-FP8 weights as DeepSeek publishes them (layers/block_fp8.py describes the layout), as
Triton kernels for CUDA; registry.BLOCK_FP8_LINEAR says where they run.

Decode batches (up to SKINNY_MAX_ROWS rows) stream the fp8 weight through fp8_decode.py's W8A16 kernels: x stays
in its dtype and only the weight is widened, in registers. Larger batches take fp8_prefill.py's W8A8 GEMM: x is
quantized per token in groups of 128 columns (fp8_quant.py, or inside the GEMM with fuse_quant) and the dot runs on
fp8 operands. Every launch is asynchronous and sized from shapes alone, so the calls can be captured in CUDA graphs.

layers/block_fp8.linear_reference is what both are tested against: as is for the W8A16 kernels, and with
quantize_activations=True for the W8A8 GEMM.
"""

import torch

from mlaserve.kernels.fit import GemmTile
from mlaserve.kernels.fp8_decode import w8a16_linear
from mlaserve.kernels.fp8_prefill import w8a8_linear
from mlaserve.kernels.fp8_quant import FP8, GROUP, quantize_per_token_group
from mlaserve.kernels.registry import SKINNY_MAX_ROWS

__all__ = ["block_fp8_linear", "quantize_per_token_group"]


def check_block_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int) -> None:
    """Raises ValueError unless x [M, K] meets an fp8 weight [N, K] with a float32 scale per group_n x 128 block."""
    n, k = weight.shape
    want = (-(-n // group_n), -(-k // GROUP))
    if (
        x.dim() != 2
        or x.shape[1] != k
        or weight.dtype != FP8
        or group_n not in (1, 128)
        or scale.dtype != torch.float32
        or tuple(scale.shape) != want
    ):
        raise ValueError(
            f"block_fp8_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"scale {tuple(scale.shape)} {scale.dtype} (want {want} float32), group_n {group_n}"
        )


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None = None,
    fuse_quant: bool = False,
    pow2_scale: bool = False,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantize(weight [N, K], scale, group_n)^T (+ bias [N]) -> [M, N] in x's dtype.

    Up to SKINNY_MAX_ROWS rows x is used as is (W8A16); beyond, x goes through per-token-group FP8 first (W8A8),
    quantized inside the GEMM with fuse_quant, with power-of-two scales with pow2_scale (ue8m0 checkpoints).
    tile forces the decode tile kernel's tile (sweeps, tests)."""
    check_block_fp8(x, weight, scale, group_n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:  # a zero-size grid is not a valid launch
        return out
    if x.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(rows, n))
    if rows <= SKINNY_MAX_ROWS:
        return w8a16_linear(x, weight, scale, group_n, bias, out, tile)
    return w8a8_linear(x, weight, scale, group_n, bias, out, fuse_quant, pow2_scale)
