"""The fused Triton RMSNorm against the torch reference, under TRITON_INTERPRET=1 on CPU (tiny sizes).

With TRITON_INTERPRET=0 on a GPU machine the same cases run compiled, on CUDA tensors.
"""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from mlaserve.kernels.norm import rms_norm  # noqa: E402
from mlaserve.layers.norm import RMSNorm, rms_norm_reference  # noqa: E402

EPS = 1e-6
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="compiled Triton needs a CUDA GPU"
)


@pytest.fixture(autouse=True)
def bf16_round_to_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreter's fp32 -> bf16 cast round to nearest even, as the GPU's does.

    The interpreter truncates it instead, which puts bf16 results up to two ulps off a correct kernel (the
    kernel rounds twice) and would make the residual stream differ from torch's `x + residual`.
    """
    if not INTERPRETED:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def rounding_cast(
        self: object, src: interpreter.TensorHandle, dst_type: tl.dtype
    ) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            # The interpreter holds bf16 as its uint16 bit pattern.
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", rounding_cast)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bf16: the fp32 sum order can flip one rounding of the normalised row, i.e. about one bf16 ulp.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def make_x(rows: int, n: int, dtype: torch.dtype, strided: bool, gen: torch.Generator) -> torch.Tensor:
    if strided:  # a column slice of a wider tensor, as kv_a_layernorm gets its latent
        return torch.randn(rows, n + 24, generator=gen).to(DEVICE, dtype)[:, 8 : 8 + n]
    return torch.randn(rows, n, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("n", [64, 100, 512, 2048])
@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),  # promotes to fp32
    ],
)
@pytest.mark.parametrize("residual", [False, True])
def test_matches_reference(
    n: int, rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype, residual: bool
) -> None:
    gen = torch.Generator().manual_seed(n * 31 + rows)
    x = make_x(rows, n, x_dtype, strided=n == 100, gen=gen)
    weight = (1 + 0.5 * torch.randn(n, generator=gen)).to(DEVICE, w_dtype)
    res = make_x(rows, n, x_dtype, strided=n == 512, gen=gen) if residual else None

    got, got_h = rms_norm(x, weight, EPS, res)

    h = x + res if residual else x
    want = rms_norm_reference(h, weight, EPS)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tolerance(x_dtype))
    if residual:
        # The add is one rounding of the exact sum in both, so the stream is bit-identical.
        assert got_h.dtype == x_dtype
        torch.testing.assert_close(got_h, h, atol=0, rtol=0)
    else:
        assert got_h is None


def test_module_on_cpu_is_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, EPS)
    norm.weight.data = torch.randn(48, generator=gen)
    x, res = torch.randn(2, 5, 48, generator=gen).unbind(0)
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, EPS))
    normed, h = norm.forward_with_residual(x, res)
    assert torch.equal(h, x + res)
    assert torch.equal(normed, rms_norm_reference(x + res, norm.weight, EPS))
