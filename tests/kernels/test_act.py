"""The one-launch SiLU-and-multiply against gated_act's torch path, under TRITON_INTERPRET=1."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.act import silu_and_mul  # noqa: E402
from mlaserve.layers.activation import gated_act  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 48), (3, 2, 2 * 1100), (0, 2 * 16)])  # 1,100 > one 1,024 block
def test_matches_torch(shape, dtype):
    gate_up = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])) * 3).to(dtype)
    want = gated_act(gate_up, "silu")  # CPU tensors: the torch path
    got = silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:  # two bf16 steps: the CPU interpreter truncates float32 -> bf16 where the GPU rounds to nearest
        torch.testing.assert_close(got, want, atol=0.0, rtol=2**-6)


def test_strided_input():
    wide = torch.randn(4, 3 * 32, generator=torch.Generator().manual_seed(1))
    gate_up = wide[:, : 2 * 32]  # rows with a stride wider than the columns used
    torch.testing.assert_close(silu_and_mul(gate_up), gated_act(gate_up.contiguous(), "silu"))
