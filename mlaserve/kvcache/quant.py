"""8-bit latent cache rows: the latent and rope values in fp8_e4m3 or int8, then the row's float32 scale.

One scale per token row (max |x| / the format's max) keeps each token's own range, and storing it in a 16-byte
tail of the row keeps one tensor per layer, so every cache consumer sees the same object (FlashMLA packs its
FP8 rows the same way). The tail is 16 bytes, not 4, so every row starts 16-byte aligned: GPU kernels copy rows
with 16-byte asynchronous loads, which fault on a misaligned address. A 576-value DeepSeek row takes 592 bytes
instead of 1,152.
"""

import torch

TAIL_BYTES = 16  # the float32 scale, then padding to keep rows 16-byte aligned
QUANTIZED = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _MAX


def quant_max(dtype: torch.dtype) -> float:
    """The largest magnitude an 8-bit row stores: a row's max |x| maps to it."""
    return _MAX[dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per cached row: the values, plus the scale's bytes for 8-bit rows."""
    return head_dim + TAIL_BYTES if is_quantized(dtype) else head_dim


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, takes_8bit: bool) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in QUANTIZED:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose 'auto', {', '.join(map(repr, QUANTIZED))}"
        )
    if not takes_8bit:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is only supported for MLA (latent) caches and DeepSeek-V4's "
            "caches so far"
        )
    return QUANTIZED[kv_cache_dtype]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., D] float -> [..., D + TAIL_BYTES] rows of `dtype` (values, the float32 scale's bytes, zero
    padding), any leading shape (a paged cache [blocks, page, 1, D] gives its pages as 8-bit rows)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / _MAX[dtype]
    y = x / scale
    values = y.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else y.to(dtype)
    scale_bytes = scale.contiguous().view(torch.uint8)
    padding = scale_bytes.new_zeros(*scale_bytes.shape[:-1], TAIL_BYTES - 4)
    return torch.cat((values.view(torch.uint8), scale_bytes, padding), dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 16] rows -> [..., D] values in out_dtype."""
    values = rows[..., :-TAIL_BYTES].float()
    scale = rows[..., -TAIL_BYTES : -TAIL_BYTES + 4].contiguous().view(torch.uint8).view(torch.float32)
    return (values * scale).to(out_dtype)
