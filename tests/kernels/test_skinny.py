"""The skinny-GEMM Triton kernels against F.linear and einsum, under TRITON_INTERPRET=1 on CPU (tiny sizes).

The tile kernel's cases run in fp16: the interpreter's tl.dot reads bf16 operands as garbage (6e10 for unit
values), so bf16 is covered on the GPU (tests/gpu/test_skinny_linear.py). The GEMV kernel (up to GEMV_MAX_ROWS
rows) has no tl.dot and runs in both."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.registry import GEMV_MAX_ROWS, LM_HEAD_WIDTH  # noqa: E402
from mlaserve.kernels.skinny import (  # noqa: E402
    per_head,
    per_head_reference,
    skinny_linear,
    skinny_linear_reference,
)

CASES = [
    # rows, out, in, weight dtype, bias
    (1, 40, 64, torch.float16, False),  # GEMV kernel from here ...
    (3, 300, 72, torch.bfloat16, True),  # several column blocks, K not a power of two
    (4, 21, 2100, torch.float16, True),  # K past one 2,048-column block
    (2, 5, 16, torch.bfloat16, False),  # fewer outputs than one block of rows
    (2, LM_HEAD_WIDTH + 3, 16, torch.float16, False),  # ... but LM-head widths keep the tile kernel
    (16, 17, 300, torch.float16, False),  # a full row tile, K over one step
    (5, 9000, 24, torch.float16, False),  # the wide-column tiles of an LM head
]


@pytest.mark.parametrize("rows,n,k,wdtype,bias", CASES)
def test_matches_f_linear(rows: int, n: int, k: int, wdtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k + 3, generator=gen)[:, 2 : 2 + k].to(wdtype)  # a strided row slice
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(wdtype)
    b = torch.randn(n, generator=gen).to(wdtype) if bias else None
    got = skinny_linear(x, w, b)
    want = skinny_linear_reference(x, w, b)
    assert got.dtype == want.dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_tile_override_gives_the_same_result() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 96, generator=gen).half(), torch.randn(70, 96, generator=gen).half()
    torch.testing.assert_close(
        skinny_linear(x, w, tile=(32, 64, 2, 2)), skinny_linear(x, w), rtol=1e-3, atol=1e-3
    )


@pytest.mark.parametrize("rows", range(GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_head_matches_einsum(rows: int, dtype: torch.dtype) -> None:
    """MLA's absorbed products: a strided query slice [T, H, nope] times [H, R, nope] per head, and back."""
    gen = torch.Generator().manual_seed(rows)
    heads, nope, rope, rank = 3, 24, 8, 40
    q = torch.randn(rows, heads, nope + rope, generator=gen).to(dtype)
    w = (torch.randn(heads, rank, nope, generator=gen) / nope**0.5).to(dtype)
    got = per_head(q[..., :nope], w)
    torch.testing.assert_close(
        got.float(), per_head_reference(q[..., :nope], w).float(), rtol=2e-2, atol=2e-2
    )
    back = (torch.randn(heads, nope, rank, generator=gen) / rank**0.5).to(dtype)
    torch.testing.assert_close(
        per_head(got, back).float(), per_head_reference(got, back).float(), rtol=2e-2, atol=2e-2
    )


def test_per_head_refuses_what_it_cannot_run() -> None:
    w = torch.randn(2, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="per_head: x \\(5, 2, 16\\)"):
        per_head(torch.zeros(GEMV_MAX_ROWS + 1, 2, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="float32"):
        per_head(torch.zeros(1, 2, 16), w.float())


def test_empty_too_many_rows_and_float32() -> None:
    w = torch.randn(8, 16, dtype=torch.float16)
    assert skinny_linear(torch.zeros(0, 16, dtype=torch.float16), w).shape == (0, 8)
    with pytest.raises(ValueError, match="x \\(17, 16\\)"):
        skinny_linear(torch.zeros(17, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="float32"):
        skinny_linear(torch.zeros(2, 16), w.float())


def test_every_tile_down_the_ladder_matches_f_linear() -> None:
    """Each tile the ladder may fall back to (kernels/fit.py), at widths no multiple of a tile."""
    from mlaserve.kernels.skinny import tile_for, tile_ladder

    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 200, generator=gen).half(), (torch.randn(1900, 200, generator=gen) / 15).half()
    want = skinny_linear_reference(x, w, None)
    rungs = tile_ladder(tile_for(1900), 200, 2, 232_448)
    assert len(rungs) > 3
    for tile in rungs:
        got = skinny_linear(x, w, tile=tile)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=str(tile))
