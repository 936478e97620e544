"""The MXFP4 experts' grouped GEMM (kernels/moe/mxfp4_gemm.py) against the torch loop over the dequantized experts
(layers/mxfp4_experts.experts_reference): one pair per tile and sorted tiles, gated stage and down stage, widths
that leave partial tiles, in each dtype the device's kernels take."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.moe.mxfp4_gemm import mxfp4_experts  # noqa: E402
from mlaserve.layers import mxfp4  # noqa: E402
from mlaserve.layers.mxfp4_experts import experts_reference  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes  # noqa: E402


def _case(tokens, experts, top_k, hidden, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = mxfp4.quantize(torch.randn(experts, 2 * inter, hidden, generator=gen))
    w2, s2 = mxfp4.quantize(torch.randn(experts, hidden, inter, generator=gen) * 0.3)
    x = torch.randn(tokens, hidden, generator=gen) * 0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x.to(dtype), w13, s13, w2, s2, ids, weights)]


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [
        (1, 8, 2, 64, 32),  # pair tiles: a pair per four experts or fewer
        (2, 16, 2, 96, 32),
        (9, 4, 2, 64, 96),  # sorted tiles, partial N and K tiles
        (40, 6, 3, 128, 64),
    ],
)
@pytest.mark.parametrize("dtype", kernel_test_dtypes())  # the interpreter's dot misreads bf16
def test_mxfp4_experts_match_the_reference(device, tokens, experts, top_k, hidden, inter, dtype):
    x, w13, s13, w2, s2, ids, weights = _case(tokens, experts, top_k, hidden, inter, dtype, device)
    limit = 2.0  # the clamps bind: gate values reach well past it
    got = mxfp4_experts(x, w13, s13, w2, s2, ids, weights, limit)
    want = experts_reference(x, w13, s13, w2, s2, ids, weights, limit)
    # in bf16 the gated activations reach the second GEMM rounded to bf16 where the reference keeps float32, so
    # an output's error follows the size of the sum it came from, not its own
    scale = want.float().abs().amax().item()
    tol = (
        dict(rtol=1e-4, atol=1e-4)
        if dtype == torch.float32
        else dict(rtol=2e-2, atol=max(3e-2, 2e-2 * scale))
    )
    torch.testing.assert_close(got.float(), want.float(), **tol)
