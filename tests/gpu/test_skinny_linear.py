"""On a GPU (skipped in CI): the skinny-GEMM kernel in bf16 (the interpreter cannot run bf16 dots) at decode-sized
batches and V2-Lite's projection shapes, and the float32 router gate, against F.linear."""

import pytest
import torch

from mlaserve.layers.triton_skinny import skinny_linear, skinny_linear_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("n, k, wdtype", [(3072, 2048, torch.bfloat16), (576, 2048, torch.bfloat16),
                                          (2048, 1408, torch.bfloat16), (102400, 2048, torch.bfloat16),
                                          (64, 2048, torch.float32)])  # fmt: skip
def test_skinny_matches_f_linear(rows, n, k, wdtype):
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(wdtype)
    out_dtype = torch.float32 if wdtype == torch.float32 else None
    got = skinny_linear(x, w, out_dtype=out_dtype)
    want = skinny_linear_reference(x, w, out_dtype=out_dtype)
    tol = 1e-4 if wdtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
