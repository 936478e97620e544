"""On a GPU (skipped in CI): the skinny-GEMM kernel in bf16 (the interpreter cannot run bf16 dots) at decode-sized
batches and V2-Lite's projection shapes, every tile class, against F.linear; and the float32 router gate."""

import pytest
import torch

from mlaserve.layers.triton_skinny import skinny_linear, skinny_linear_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("n, k", [(3072, 2048), (576, 2048), (2048, 1408), (102400, 2048)])
def test_skinny_matches_f_linear(rows, n, k):
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    torch.testing.assert_close(
        skinny_linear(x, w).float(), skinny_linear_reference(x, w).float(), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gate_logits_match_float32_linear(rows):
    from mlaserve.layers.triton_router import gate_logits

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(64, 2048, device="cuda", generator=gen) / 2048**0.5
    want = torch.nn.functional.linear(x.float(), w)
    torch.testing.assert_close(gate_logits(x, w), want, atol=1e-4, rtol=1e-4)
