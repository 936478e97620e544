"""Linear layers over block-FP8 weights as DeepSeek publishes them (layers/block_fp8.py describes the layout), as
Triton kernels for CUDA; registry.BLOCK_FP8_LINEAR says where they run.

The paths, chosen by row count (dense_path; the constants below are what the fp8_paths section of the GPU suite,
benchmarks/gpu_fp8_paths.py, measures and sets):
- w8a16: decode batches (up to W8A16_MAX_ROWS) stream the fp8 weight through fp8_decode.py's kernels; x stays in
  its dtype and only the weight is widened, in registers. The kernels take any row count (taller row tiles past
  16 rows), so a measurement may move the threshold up.
- w8a8: fp8_prefill.py's GEMM: x quantized per token in groups of 128 columns (fp8_quant.py, or inside the GEMM with
  fuse_quant) and the dot on fp8 operands.
- torch_blockwise: the same product through torch's blockwise-scaled GEMM (fp8_torch.py), where this torch and
  device have it (a one-time check on the device) and the widths are whole scale blocks: prompts and large batches.
- dequant_cublas: the weight dequantized to x's dtype for the call (fp8_dequant.py), then cuBLAS: long prompts.
- flashinfer_blockscale: a peer, FlashInfer's sm_90 block-scaled GEMM (fp8_flashinfer.py), where FlashInfer is
  installed and passed its one-time check on the device; off (FLASHINFER_MIN_ROWS None) until the fp8_paths
  section has measured it beside ours, which stay the fallback wherever it cannot take a call.
Every launch is asynchronous and sized from shapes alone, so the calls can be captured in CUDA graphs.

layers/block_fp8.linear_reference is what all are tested against: as is for w8a16 and dequant_cublas, with
quantize_activations=True for the two W8A8 paths.
"""

import torch

from mlaserve.kernels.fit import GemmTile
from mlaserve.kernels.fp8_decode import w8a16_linear
from mlaserve.kernels.fp8_dequant import dequant_linear
from mlaserve.kernels.fp8_flashinfer import (
    flashinfer_blockscale_linear,
    flashinfer_blockscale_problem,
    flashinfer_check,
)
from mlaserve.kernels.fp8_prefill import w8a8_linear
from mlaserve.kernels.fp8_quant import FP8, GROUP, quantize_per_token_group
from mlaserve.kernels.fp8_torch import (
    LAYOUTS,
    blockwise_check,
    torch_blockwise_linear,
    torch_blockwise_problem,
)
from mlaserve.kernels.registry import SKINNY_MAX_ROWS

__all__ = ["block_fp8_linear", "dense_path", "quantize_per_token_group"]

W8A16, W8A8, TORCH_BLOCKWISE, DEQUANT_CUBLAS = "w8a16", "w8a8", "torch_blockwise", "dequant_cublas"
FLASHINFER_BLOCKSCALE = "flashinfer_blockscale"
DENSE_PATHS = (W8A16, W8A8, TORCH_BLOCKWISE, DEQUANT_CUBLAS, FLASHINFER_BLOCKSCALE)
# Up to this many rows x stays in its dtype (w8a16): one 16-row tile of fp8_decode.py's tile kernel.
W8A16_MAX_ROWS = SKINNY_MAX_ROWS
# From this many rows torch's blockwise-scaled GEMM (cuBLASLt) replaces the W8A8 Triton GEMM where its check passed
# and its widths fit; None: never. On an H100 it was the faster of the two on V3's projections from 128 rows on
# (from 16 on some), and at 4,096 rows the fastest path of all, bf16 cuBLAS included.
TORCH_BLOCKWISE_MIN_ROWS: int | None = 128
# From this many rows the weight is dequantized per call and cuBLAS multiplies (dequant_cublas); None: never. It
# won at every V2-Lite and V3 projection at 4,096 rows and lost V3's at 512 and 1,024 (fp8_paths and fp8_tiles
# sections).
DEQUANT_MIN_ROWS: int | None = 2048
# From this many rows, up to FLASHINFER_MAX_ROWS (None: no bound), FlashInfer's GEMM takes the calls it can where it
# imports and passed its check, ahead of all of ours (decode sizes included: its small-M kernel swaps A and B);
# None: never. Off: not yet measured on a GPU beside ours (the fp8_paths section's flashinfer_blockscale column
# says where it would win).
FLASHINFER_MIN_ROWS: int | None = None
FLASHINFER_MAX_ROWS: int | None = None


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


def torch_blockwise_layout(x: torch.Tensor, weight: torch.Tensor, group_n: int) -> str | None:
    """The weight scale layout for torch's blockwise GEMM where it can take this call and passed its one-time
    check on x's device; else None."""
    if torch_blockwise_problem(x, weight, group_n) is not None:
        return None
    layout = blockwise_check(x.device, group_n)
    return layout if layout in LAYOUTS else None


def flashinfer_usable(x: torch.Tensor, weight: torch.Tensor, group_n: int) -> str | None:
    """None where FlashInfer's GEMM can take this call and passed its one-time check on x's device; else why not."""
    problem = flashinfer_blockscale_problem(x, weight, group_n)
    if problem is not None:
        return problem
    check = flashinfer_check(x.device, group_n)
    return None if check == "ok" else check


def flashinfer_rows(rows: int) -> bool:
    """Whether the table sends this many rows to FlashInfer where it can take them."""
    if FLASHINFER_MIN_ROWS is None or rows < FLASHINFER_MIN_ROWS:
        return False
    return FLASHINFER_MAX_ROWS is None or rows <= FLASHINFER_MAX_ROWS


def dense_path(x: torch.Tensor, weight: torch.Tensor, group_n: int, pow2_scale: bool = False) -> str:
    """The path block_fp8_linear takes for a call it was not told a path for. FlashInfer rounds activation scales
    its own way, never to powers of two, so calls that ask for those (ue8m0 checkpoints) stay on ours."""
    rows = x.shape[0]
    if not pow2_scale and flashinfer_rows(rows) and flashinfer_usable(x, weight, group_n) is None:
        return FLASHINFER_BLOCKSCALE
    if rows <= W8A16_MAX_ROWS:
        return W8A16
    if TORCH_BLOCKWISE_MIN_ROWS is not None and rows >= TORCH_BLOCKWISE_MIN_ROWS:
        if torch_blockwise_layout(x, weight, group_n) is not None:
            return TORCH_BLOCKWISE
    if DEQUANT_MIN_ROWS is not None and rows >= DEQUANT_MIN_ROWS:
        return DEQUANT_CUBLAS
    return W8A8


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None = None,
    fuse_quant: bool = False,
    pow2_scale: bool = False,
    tile: GemmTile | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantize(weight [N, K], scale, group_n)^T (+ bias [N]) -> [M, N] in x's dtype.

    The path is dense_path's unless `path` forces one of DENSE_PATHS (benchmarks, tests; ValueError where it cannot
    take the call). Up to W8A16_MAX_ROWS rows x is used as is (W8A16); beyond, x goes through per-token-group FP8
    first (W8A8), quantized inside the GEMM with fuse_quant, with power-of-two scales with pow2_scale (ue8m0
    checkpoints). tile forces the decode tile kernel's tile (sweeps, tests)."""
    check_block_fp8(x, weight, scale, group_n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    rows, n = x.shape[0], weight.shape[0]
    if path is not None and path not in DENSE_PATHS:
        raise ValueError(f"block_fp8_linear: path {path!r}, not one of {DENSE_PATHS}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:  # a zero-size grid is not a valid launch
        return out
    if x.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(rows, n))
    path = path or dense_path(x, weight, group_n, pow2_scale)
    if path == W8A16:
        return w8a16_linear(x, weight, scale, group_n, bias, out, tile)
    if path == TORCH_BLOCKWISE:
        layout = torch_blockwise_layout(x, weight, group_n)
        if layout is None:
            why = torch_blockwise_problem(x, weight, group_n) or blockwise_check(x.device, group_n)
            raise ValueError(f"block_fp8_linear: torch_blockwise cannot take this call: {why}")
        return torch_blockwise_linear(x, weight, scale, group_n, bias, pow2_scale, layout)
    if path == DEQUANT_CUBLAS:
        return dequant_linear(x, weight, scale, group_n, bias)
    if path == FLASHINFER_BLOCKSCALE:
        why = (
            "its activation scales are never powers of two"
            if pow2_scale
            else flashinfer_usable(x, weight, group_n)
        )
        if why is not None:
            raise ValueError(f"block_fp8_linear: flashinfer_blockscale cannot take this call: {why}")
        return flashinfer_blockscale_linear(x, weight, scale, bias, out)
    return w8a8_linear(x, weight, scale, group_n, bias, out, fuse_quant, pow2_scale)
