"""Block-FP8 weights as DeepSeek publishes them, in torch: the CPU path of every FP8 layer and the reference its
kernels are checked against.

A weight is `float8_e4m3fn` [..., N, K] with a float32 scale per block of `group_n` rows x BLOCK_K columns:
w[n, k] = weight[n, k] * scale[n // group_n, k // BLOCK_K]. A checkpoint's `weight_scale_inv` is that scale (its
name says it is the inverse of the quantizer's). The engine keeps DeepSeek's 128-row blocks where a layer's parts
start on block rows, and one scale row per weight row (group_n = 1) where fused parts do not (a 96-row q_a
projection before kv_a): the same scales, repeated, so loading never requantizes. Widths need not be multiples of
the block: the last block row and column are partial.
"""

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK_K = 128  # the published block width; activations are quantized in groups of the same width
BLOCK_N = 128


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def expand_scale(
    scale: torch.Tensor, rows: int, cols: int, group_n: int, block_k: int = BLOCK_K
) -> torch.Tensor:
    """[..., ceil(rows/group_n), ceil(cols/block_k)] scales to one per element [..., rows, cols] (float32)."""
    full = scale.float().repeat_interleave(group_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return full[..., :rows, :cols]


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, group_n: int, block_k: int = BLOCK_K
) -> torch.Tensor:
    """The float32 weight a block-FP8 weight stands for."""
    return weight.float() * expand_scale(scale, weight.shape[-2], weight.shape[-1], group_n, block_k)


def quantize(
    w: torch.Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale) of a float weight [..., N, K] in blocks of block_n x block_k, each block's
    scale its largest magnitude over FP8_MAX (online quantization; DeepSeek's own conversion does the same)."""
    *lead, n, k = w.shape
    nb, kb = blocks(n, block_n), blocks(k, block_k)
    padded = w.new_zeros(*lead, nb * block_n, kb * block_k, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    tiles = padded.view(*lead, nb, block_n, kb, block_k)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * block_n, kb * block_k)[..., :n, :k].contiguous(), scale


def quantize_per_token_group(
    x: torch.Tensor, group: int = BLOCK_K, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: (fp8 x, float32 scale [..., ceil(K/group)]) with one scale per token per
    `group` columns; pow2_scale rounds each scale up to a power of two (checkpoints with scale_fmt ue8m0)."""
    k = x.shape[-1]
    kb = blocks(k, group)
    padded = F.pad(x.float(), (0, kb * group - k)).view(*x.shape[:-1], kb, group)
    # times the reciprocal, spelled out: torch divides by a scalar that way on CUDA but not on CPU, and the
    # kernels must match both to the bit
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) * (1.0 / FP8_MAX)
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*x.shape[:-1], kb * group)[..., :k].contiguous(), scale


def fake_quantize_per_token_group(x: torch.Tensor) -> torch.Tensor:
    """x through per-token-group FP8 and back, in x's dtype: what a W8A8 kernel's dot sees of its activations."""
    q, s = quantize_per_token_group(x)
    return (q.float() * s.repeat_interleave(BLOCK_K, dim=-1)[..., : x.shape[-1]]).to(x.dtype)


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_n: int,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """x @ dequantize(weight)^T (+ bias) in float32, returned in x's dtype; with quantize_activations, x first
    goes through per-token-group FP8 (what a W8A8 kernel computes)."""
    xf = (fake_quantize_per_token_group(x) if quantize_activations else x).float()
    out = F.linear(xf, dequantize(weight, scale, group_n), None if bias is None else bias.float())
    return out.to(x.dtype)
