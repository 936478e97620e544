"""The skinny-GEMM Triton kernel against F.linear, under TRITON_INTERPRET=1 on CPU (tiny sizes).

They run in fp16: the interpreter's tl.dot reads bf16 operands as garbage (6e10 for unit values), so bf16 is
covered on the GPU (tests/gpu/test_skinny_linear.py)."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.layers.triton_skinny import skinny_linear, skinny_linear_reference  # noqa: E402

CASES = [
    # rows, out, in, weight dtype, bias
    (1, 40, 64, torch.float16, False),
    (3, 300, 72, torch.float16, True),  # several column blocks, K not a multiple of the K step
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


def test_empty_too_many_rows_and_float32() -> None:
    w = torch.randn(8, 16, dtype=torch.float16)
    assert skinny_linear(torch.zeros(0, 16, dtype=torch.float16), w).shape == (0, 8)
    with pytest.raises(ValueError, match="x \\(17, 16\\)"):
        skinny_linear(torch.zeros(17, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="float32"):
        skinny_linear(torch.zeros(2, 16), w.float())
