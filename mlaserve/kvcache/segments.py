"""Cache rows of several parts, each part an 8-bit row of its own in 8-bit caches (DeepSeek-V4: a token's kv, then
its compressor's and its indexer's projections; an entry's kv, then its indexer key).

Each part keeps its own scale (kvcache/quant.py's layout: values, then a 16-byte tail holding the float32 scale)
because the parts' ranges differ by orders of magnitude: a normed kv row, raw gate projections, indexer keys. One
scale over the whole row would round the smaller parts to nothing. And with each part laid out as the engine's other
8-bit rows, a kernel reads a part as a strided view of the cache, exactly as it reads a latent cache (its kernels
find the scale at the end of the values they are told the width of). In 16- and 32-bit caches the parts are plain
adjacent values and reading one is a slice, no copy.
"""

from collections.abc import Sequence

import torch

from mlaserve.kvcache.quant import dequantize_rows, is_quantized, quantize_rows, row_width


def stored_width(widths: Sequence[int], dtype: torch.dtype) -> int:
    """Elements a row of these parts takes in a cache of `dtype`."""
    return sum(row_width(w, dtype) for w in widths)


def part_bounds(widths: Sequence[int], index: int, dtype: torch.dtype) -> slice:
    """The elements of part `index` in a cached row (in 8-bit caches with its scale's tail)."""
    start = stored_width(widths[:index], dtype)
    return slice(start, start + row_width(widths[index], dtype))


def pack(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[..., sum(widths)] float parts -> rows [..., stored_width] of `dtype`, each part scaled on its own."""
    if not is_quantized(dtype):
        return torch.cat([p.to(dtype) for p in parts], dim=-1)
    return torch.cat([quantize_rows(p, dtype) for p in parts], dim=-1)


def stored_part(rows: torch.Tensor, widths: Sequence[int], index: int) -> torch.Tensor:
    """Part `index` of cached rows as stored (a view; 8-bit: values then tail), for the kernels."""
    return rows[..., part_bounds(widths, index, rows.dtype)]


def read(
    rows: torch.Tensor,
    widths: Sequence[int],
    index: int,
    out_dtype: torch.dtype,
    at: torch.Tensor | None = None,
) -> torch.Tensor:
    """Part `index` of cached rows [..., stored_width] as values [..., widths[index]] of out_dtype; with `at`, of
    rows[at] only (the part is cut before the gather, so the other parts are never copied)."""
    part = stored_part(rows, widths, index)
    part = part if at is None else part[at]
    return dequantize_rows(part, out_dtype) if is_quantized(rows.dtype) else part.to(out_dtype)
