"""torch's own blockwise-scaled FP8 GEMM (torch._scaled_mm: cuBLASLt's 1x128 activation and 128x128 or 1x128 weight
block scaling, sm_90 with CUDA 12.9 and newer) as a candidate for block-FP8 linears of prefill-sized batches.

It is feature-detected twice: `torch_blockwise_problem` says from shapes and the build alone whether a call could
go there (never on CPU, never on a torch without torch._scaled_mm), and `blockwise_check` runs one small GEMM per
device and scale grouping, once, against layers/block_fp8.linear_reference. The check also finds the weight scale's
layout this torch wants: torch releases differ on whether a 128x128 scale's rows are padded to four columns. A
device that fails the check is never used. kernels/block_fp8.py's table says from which row count it runs (off
until measured). Each call lays the weight scale out as torch wants it (a small copy for one scale per weight row or
the padded layout); were the path to win, the loader could store the scale that way once.
"""

import torch
import torch.nn.functional as F

from mlaserve.kernels.device_check import checked_once
from mlaserve.kernels.fp8_quant import GROUP, quantize_per_token_group

# The weight scale layouts torch releases have asked for, in the order the check tries them: through
# torch.nn.functional.scaled_mm with the recipes named ("recipes", where this torch has it), or torch._scaled_mm
# inferring them from the scales' shapes, a 128x128 scale's rows as they are, padded to four columns but viewed at
# their own width, or padded and viewed whole.
LAYOUTS = ("recipes", "plain", "padded", "padded_full")
# (device index, group_n) -> the layout that passed, or why none did; filled outside graph capture, never cleared.
_CHECKED: dict[tuple[int, int], str] = {}


def torch_blockwise_problem(x: torch.Tensor, weight: torch.Tensor, group_n: int) -> str | None:
    """None where torch._scaled_mm's blockwise scaling could take the call; else why not. Widths: K in whole
    128-column groups (the scale blocks), N in 16-byte rows (cuBLASLt's fp8 alignment)."""
    if not hasattr(torch, "_scaled_mm"):
        return "needs torch._scaled_mm"
    if not x.is_cuda or torch.version.hip is not None:
        return "needs a CUDA device"
    if x.dtype != torch.bfloat16:
        return f"writes bf16 only, not {x.dtype}"
    if group_n not in (1, GROUP):
        return f"takes weight scales of 1 or {GROUP} rows, not {group_n}"
    n, k = weight.shape
    if k % GROUP or n % (GROUP if group_n == GROUP else 16):
        want = f"{GROUP} (whole scale blocks)" if group_n == GROUP else "16"
        return f"takes K in whole {GROUP}-column groups and N in multiples of {want}, not N {n}, K {k}"
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return "needs sm_90 or newer"
    return None


def weight_scale_for_torch(scale: torch.Tensor, group_n: int, layout: str) -> torch.Tensor:
    """The block-FP8 weight scale [ceil(N/group_n), K/128] as torch's scale_b for the weight's transpose: its
    transpose [K/128, ...] whose own transpose is row-major (128x128 blocks, rows padded to four columns in the
    padded layouts) or column-major (one scale per weight row; [N, K/128] as it is with the named recipes)."""
    if group_n == 1:
        return scale.t().contiguous().t() if layout == "recipes" else scale.t().contiguous()
    if layout == "plain" or (layout == "padded" and scale.shape[1] % 4 == 0):
        return scale.contiguous().t()
    padded = scale.new_zeros(scale.shape[0], -(-scale.shape[1] // 4) * 4)
    padded[:, : scale.shape[1]] = scale
    return padded[:, : scale.shape[1]].t() if layout == "padded" else padded.t()  # padded_full, recipes


def _scaled_mm(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, group_n: int, layout: str
) -> torch.Tensor:
    if layout != "recipes":
        return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
    recipe = F.ScalingType.BlockWise128x128 if group_n == GROUP else F.ScalingType.BlockWise1x128
    return F.scaled_mm(
        a, b, a_scale, F.ScalingType.BlockWise1x128, b_scale, recipe, output_dtype=torch.bfloat16
    )


def torch_blockwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None = None,
    pow2_scale: bool = False,
    layout: str = "plain",
) -> torch.Tensor:
    """quantize_per_token_group(x) @ (weight * scale)^T (+ bias) through torch._scaled_mm's blockwise scaling,
    in bf16: the W8A8 product, summed by cuBLASLt. The caller has checked torch_blockwise_problem."""
    a, a_scale = quantize_per_token_group(x, GROUP, pow2_scale, column_major_scale=True)
    b_scale = weight_scale_for_torch(scale, group_n, layout)
    out = _scaled_mm(a, weight.t(), a_scale, b_scale, group_n, layout)
    return out if bias is None else out.add_(bias)


def blockwise_check(device: torch.device, group_n: int) -> str:
    """The weight scale layout with which torch's blockwise GEMM matched the reference on `device` for this
    grouping, or "failed: why", from one small GEMM run the first time it is asked (never during graph capture:
    then "unchecked", and it is asked again later)."""
    return checked_once(_CHECKED, device, group_n, _run_check)


def _run_check(device: torch.device, group_n: int) -> str:
    from mlaserve.layers.block_fp8 import linear_reference, quantize

    gen = torch.Generator(device=device).manual_seed(0)
    # K of three groups: a 128x128 scale row of three columns tells the plain layout from the padded one
    n, k = 256, 3 * GROUP
    weight, scale = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5, block_n=group_n)
    x = torch.randn(48, k, device=device, generator=gen).bfloat16()
    want = linear_reference(x, weight, scale, group_n, quantize_activations=True).float()
    problem = torch_blockwise_problem(x, weight, group_n)
    if problem is not None:
        return f"failed: {problem}"
    reasons = []
    for layout in LAYOUTS:
        try:
            got = torch_blockwise_linear(x, weight, scale, group_n, layout=layout).float()
        except Exception as error:  # noqa: BLE001 - however this torch refuses, the path stays off
            reasons.append(f"{layout}: {str(error).splitlines()[0]}")
            continue
        error = ((got - want).abs().max() / want.abs().max()).item()
        if error < 2e-2:
            return layout
        reasons.append(f"{layout}: relative error {error:.3g}")
    return "failed: " + "; ".join(reasons)
