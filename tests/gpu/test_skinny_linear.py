"""On a GPU (skipped in CI): the skinny-GEMM kernels in bf16 (the interpreter cannot run bf16 dots) at decode-sized
batches and V2-Lite's projection shapes, every tile class and the GEMV kernel, against F.linear; MLA's per-head
products against einsum, also chained inside a CUDA graph (their launches use programmatic dependent launch, whose
waits a race would show); and the float32 router gate."""

import pytest
import torch

from mlaserve.kernels.skinny import per_head, per_head_reference, skinny_linear, skinny_linear_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("n, k", [(3648, 2048), (576, 2048), (2048, 1408), (2048, 10944), (102400, 2048)])
def test_skinny_matches_f_linear(rows, n, k):
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    torch.testing.assert_close(
        skinny_linear(x, w).float(), skinny_linear_reference(x, w).float(), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gate_logits_match_float32_linear(rows):
    from mlaserve.kernels.router import gate_logits

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(64, 2048, device="cuda", generator=gen) / 2048**0.5
    want = torch.nn.functional.linear(x.float(), w)
    torch.testing.assert_close(gate_logits(x, w), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_per_head_chained_in_a_graph(rows):
    """V2-Lite's absorbed products (16 heads, nope 128, rank 512) back to back in one graph, 5 rounds (10 launches,
    each reading the one before)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w_uk = (torch.randn(16, 512, 128, device="cuda", generator=gen) / 128**0.5).to(torch.bfloat16)
    w_uv = (torch.randn(16, 128, 512, device="cuda", generator=gen) / 512**0.5).to(torch.bfloat16)
    q = torch.randn(rows, 16, 192, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(fn):
        x = q[..., :128]
        for _ in range(5):
            x = fn(fn(x, w_uk), w_uv)
        return x

    want = chain(per_head_reference)
    chain(per_head)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(per_head)
    graph.replay()
    torch.cuda.synchronize()
    # Random products stretch some directions each round: compare against the largest value, not elementwise.
    assert (got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max()
