"""The skinny-GEMM Triton kernel against F.linear, under TRITON_INTERPRET=1 on CPU (tiny sizes).

16-bit cases run in fp16: the interpreter's tl.dot reads bf16 operands as garbage (6e10 for unit values), so bf16
is covered on the GPU (tests/gpu/test_skinny_linear.py); bf16 rows widened for the float32 gate work here."""

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
    (2, 64, 200, torch.float32, False),  # the router's float32 gate on bf16 rows
]


@pytest.mark.parametrize("rows,n,k,wdtype,bias", CASES)
def test_matches_f_linear(rows: int, n: int, k: int, wdtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    xdtype = torch.bfloat16 if wdtype == torch.float32 else wdtype
    x = torch.randn(rows, k + 3, generator=gen)[:, 2 : 2 + k].to(xdtype)  # a strided row slice
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(wdtype)
    b = torch.randn(n, generator=gen).to(wdtype) if bias else None
    out_dtype = torch.float32 if wdtype == torch.float32 else None
    got = skinny_linear(x, w, b, out_dtype=out_dtype)
    want = skinny_linear_reference(x, w, b, out_dtype=out_dtype)
    assert got.dtype == want.dtype and got.shape == (rows, n)
    tol = 1e-5 if wdtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_empty_and_too_many_rows() -> None:
    w = torch.randn(8, 16, dtype=torch.float16)
    assert skinny_linear(torch.zeros(0, 16, dtype=torch.float16), w).shape == (0, 8)
    with pytest.raises(ValueError, match="x \\(17, 16\\)"):
        skinny_linear(torch.zeros(17, 16, dtype=torch.float16), w)
