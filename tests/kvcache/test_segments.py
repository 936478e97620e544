"""Rows of several parts (kvcache/segments.py): each part of an 8-bit row keeps its own scale, so parts of very
different ranges survive together; 16- and 32-bit rows are the parts side by side."""

import pytest
import torch

from mlaserve.kvcache import segments
from mlaserve.kvcache.spec import LayerCacheSpec

WIDTHS = (32, 64, 16)


def parts(gen: torch.Generator) -> list[torch.Tensor]:
    # a normed kv, projections a thousand times larger, keys a thousand times smaller
    return [torch.randn(5, w, generator=gen) * s for w, s in zip(WIDTHS, (1.0, 1e3, 1e-3), strict=True)]


@pytest.mark.parametrize("dtype, rel", [(torch.float8_e4m3fn, 0.07), (torch.int8, 0.01)], ids=str)
def test_each_part_keeps_its_own_range(dtype, rel):
    values = parts(torch.Generator().manual_seed(0))
    rows = segments.pack(values, dtype)
    assert rows.dtype == dtype and rows.shape == (5, sum(WIDTHS) + 3 * 16)
    assert segments.stored_width(WIDTHS, dtype) == rows.shape[-1]
    for i, want in enumerate(values):
        got = segments.read(rows, WIDTHS, i, torch.float32)
        err = (got - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)
        assert err.max() < rel, (i, err.max())
    at = torch.tensor([4, 0, 4])
    assert torch.equal(
        segments.read(rows, WIDTHS, 1, torch.float32, at), segments.read(rows[at], WIDTHS, 1, torch.float32)
    )


def test_16_and_32_bit_rows_are_the_parts_side_by_side():
    values = parts(torch.Generator().manual_seed(1))
    rows = segments.pack(values, torch.float32)
    assert torch.equal(rows, torch.cat(values, dim=-1))
    assert segments.part_bounds(WIDTHS, 2, torch.float32) == slice(96, 112)
    assert segments.part_bounds(WIDTHS, 2, torch.int8) == slice(128, 160)  # values, then the tail
    assert segments.read(rows, WIDTHS, 1, torch.float32).data_ptr() == rows[:, 32:].data_ptr()  # no copy


def test_a_layer_spec_counts_a_tail_per_part_in_8bit_caches():
    layer = LayerCacheSpec(1, sum(WIDTHS), False, entry_dim=48, entry_ratio=4, row_parts=3, entry_parts=2)
    assert layer.row_elements(torch.int8) == 112 + 48 and layer.entry_bytes(torch.int8) == 48 + 32
    assert layer.row_elements(torch.bfloat16) == 112 and layer.entry_bytes(torch.bfloat16) == 96
