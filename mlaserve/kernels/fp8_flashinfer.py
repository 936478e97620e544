"""FlashInfer's block-scaled FP8 GEMM for Hopper (flashinfer.gemm.fp8_blockscale_gemm_sm90) as a candidate for
block-FP8 linears: TensorRT-LLM's port of DeepGEMM's sm_90a kernel. Called with x in bf16 and the fp8 weight, it
quantizes x per token in groups of 128 itself (one kernel) and then multiplies with 1x128 activation and 128x128
weight scales, our layout as it is: no scale is converted. Its Python entry also accepts one scale per weight row,
but the sm_90 kernel indexes the weight scale by 128-row block only, so such weights stay on our paths.

What it costs to use: the module (fp8_blockscale_gemm_90) is JIT-compiled with nvcc on first use from sources the
slim peer wheel lacks (dev/flashinfer_prefill_peer.py --kernels fp8_blockscale_gemm puts them back), and each new
(N, K, tile) then gets its own kernel built by NVRTC on the first call of that shape: the first call of a shape is
slow and must not be the one a CUDA graph captures. Widths: K in whole 128-column groups, N a multiple of 64; sm_90
only (it refuses Blackwell); writes bf16.

Feature-detected as fp8_torch.py's GEMM is: `flashinfer_blockscale_problem` from shapes, device and whether
FlashInfer imports (never on CPU, never importing it there), then `flashinfer_check` runs one small GEMM per device
and grouping, once, against layers/block_fp8.linear_reference. kernels/block_fp8.py's table says from which row
count it runs (off until the fp8_paths section has measured it).
"""

import importlib
from types import ModuleType

import torch

from mlaserve.kernels.device_check import checked_once
from mlaserve.kernels.fp8_quant import GROUP

# FlashInfer's own limit on N (its tiles are 64 columns wide), beside K in whole scale groups.
N_MULTIPLE = 64
# the import's outcome (the module, or why not) and (device index, group_n) -> "ok" or "failed: why"; filled
# outside graph capture, never cleared: a FlashInfer that failed once is not tried again in this process.
_IMPORTED: dict[str, ModuleType | str] = {}
_CHECKED: dict[tuple[int, int], str] = {}


def flashinfer_gemm() -> ModuleType | str:
    """flashinfer.gemm where FlashInfer imports and has the sm_90 entry point; else why not."""
    if "gemm" not in _IMPORTED:
        try:
            gemm = importlib.import_module("flashinfer.gemm")
            _IMPORTED["gemm"] = (
                gemm if hasattr(gemm, "fp8_blockscale_gemm_sm90") else "no fp8_blockscale_gemm_sm90"
            )
        except Exception as error:  # noqa: BLE001 - however FlashInfer fails to import, the path stays off
            _IMPORTED["gemm"] = f"FlashInfer does not import: {type(error).__name__}: {error}".splitlines()[0]
    return _IMPORTED["gemm"]


def flashinfer_blockscale_problem(x: torch.Tensor, weight: torch.Tensor, group_n: int) -> str | None:
    """None where FlashInfer's sm_90 block-scaled GEMM could take the call; else why not. FlashInfer is imported
    only once shapes and device fit."""
    if not x.is_cuda or torch.version.hip is not None:
        return "needs a CUDA device"
    if x.dtype != torch.bfloat16:
        return f"takes bf16 activations only, not {x.dtype}"
    if group_n != GROUP:
        return f"takes weight scales of {GROUP}x{GROUP} blocks only, not of {group_n} rows"
    n, k = weight.shape
    if k % GROUP or n % N_MULTIPLE:
        return f"takes K in whole {GROUP}-column groups and N in multiples of {N_MULTIPLE}, not N {n}, K {k}"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return "needs sm_90 (Hopper)"
    gemm = flashinfer_gemm()
    return gemm if isinstance(gemm, str) else None


def flashinfer_blockscale_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize_per_token_group(x) @ (weight * scale)^T (+ bias) in bf16 through FlashInfer, into `out` [M, N] bf16
    where given; the caller has checked flashinfer_blockscale_problem (so flashinfer_gemm() is the module)."""
    gemm = flashinfer_gemm()
    if isinstance(gemm, str):
        raise RuntimeError(f"flashinfer_blockscale_linear: {gemm}")
    out = gemm.fp8_blockscale_gemm_sm90(x, weight, None, scale, out=out, out_dtype=torch.bfloat16)
    return out if bias is None else out.add_(bias)


def flashinfer_check(device: torch.device, group_n: int) -> str:
    """The word ok where FlashInfer's GEMM matched the reference on `device` for this grouping, else "failed: why",
    from one small GEMM run the first time it is asked (never during graph capture: then "unchecked")."""
    return checked_once(_CHECKED, device, group_n, _run_check)


def _run_check(device: torch.device, group_n: int) -> str:
    from mlaserve.layers.block_fp8 import linear_reference, quantize

    gen = torch.Generator(device=device).manual_seed(0)
    # rows on both sides of FlashInfer's swap-AB switch (its kernel changes below 32 rows)
    n, k = 256, 3 * GROUP
    weight, scale = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5, block_n=group_n)
    problem = flashinfer_blockscale_problem(torch.empty(1, k, device=device).bfloat16(), weight, group_n)
    if problem is not None:
        return f"failed: {problem}"
    for rows in (8, 48):
        x = torch.randn(rows, k, device=device, generator=gen).bfloat16()
        want = linear_reference(x, weight, scale, group_n, quantize_activations=True).float()
        try:
            got = flashinfer_blockscale_linear(x, weight, scale).float()
        except Exception as error:  # noqa: BLE001 - however FlashInfer refuses, the path stays off
            return f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        error = ((got - want).abs().max() / want.abs().max()).item()
        if not error < 2e-2:
            return f"failed: relative error {error:.3g} at {rows} rows"
    return "ok"
