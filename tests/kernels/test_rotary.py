"""The fused Triton rotary kernel against RotaryEmbedding's torch path, under TRITON_INTERPRET=1 on CPU (tiny sizes)."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.rotary import rotary  # noqa: E402
from mlaserve.layers.rotary import RotaryEmbedding  # noqa: E402


def inv_freq_for(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def strided_heads(
    gen: torch.Generator, t: int, h: int, d: int, layout: str, dtype: torch.dtype
) -> torch.Tensor:
    """[t, h, d] random values, laid out as a model hands them to the rotation."""
    if layout == "contiguous":
        x = torch.randn(t, h, d, generator=gen)
    elif layout == "row_slice":  # a column slice of a wider fused projection: row stride > h * d
        x = torch.randn(t, h * d + 11, generator=gen)[:, 5 : 5 + h * d].view(t, h, d)
    elif layout == "unsqueezed":  # MLA's k_pe.unsqueeze(1) of a [T, lora + rope] slice (h == 1)
        x = torch.randn(t, 7 + d, generator=gen)[:, 7:].unsqueeze(1).expand(t, h, d)
    else:  # "transposed": features are not unit-stride
        x = torch.randn(t, d, h, generator=gen).transpose(1, 2)
    return x.to(dtype)


CASES = [
    # t, hq, hk, d, rot, interleaved, q layout, k layout, scaling
    (5, 4, 2, 16, 16, False, "contiguous", "contiguous", 1.0),  # Llama GQA
    (5, 3, 1, 96, 64, False, "row_slice", "row_slice", 1.0),  # partial rotary, non-power-of-two D
    (5, 4, 1, 16, 16, True, "row_slice", "unsqueezed", 1.2),  # MLA: q_pe slice, k_pe.unsqueeze(1), YaRN-like
    (1, 2, 2, 24, 12, True, "transposed", "contiguous", 0.7),  # interleaved partial, odd rotary_dim / 2
    (5, 2, 1, 192, 128, False, "row_slice", "unsqueezed", 1.0),
    (0, 4, 1, 16, 16, True, "row_slice", "unsqueezed", 1.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, hq, hk, d, rot, interleaved, q_layout, k_layout, scaling", CASES)
def test_matches_reference(t, hq, hk, d, rot, interleaved, q_layout, k_layout, scaling, dtype):
    gen = torch.Generator().manual_seed(t * 100 + d + hq)
    q = strided_heads(gen, t, hq, d, q_layout, dtype)
    k = strided_heads(gen, t, hk, d, k_layout, dtype)
    # Scattered positions up to 5000, read through a stride: large angles exercise cos/sin range reduction.
    positions = torch.randint(0, 5000, (2 * t,), generator=gen)[::2]
    rope = RotaryEmbedding(inv_freq_for(rot), scaling, interleaved=interleaved)

    got_q, got_k = rotary(positions, q, k, rope.inv_freq, rope.scaling, rope.rotary_dim, interleaved)
    want_q, want_k = rope(positions, q, k)

    for got, want, x in ((got_q, want_q, q), (got_k, want_k, k)):
        assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
        assert torch.equal(got[..., rot:], x[..., rot:])  # passed through untouched
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            # The reference rounds cos/sin and each product to bf16; the kernel rounds once, from fp32.
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            exact = rope(positions, x.float(), x.float())[0].to(dtype)
            torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-2)


def test_rotate_heads_is_the_reference_on_cpu():
    # On CPU the llama path must stay bit-identical to rotate(cos_sin(...)).
    gen = torch.Generator().manual_seed(0)
    qk = torch.randn(3, 6 * 16 + 20, generator=gen)[:, : 6 * 16].view(3, 6, 16)
    positions = torch.tensor([0, 17, 4095])
    rope = RotaryEmbedding(inv_freq_for(16), 1.0)
    assert torch.equal(rope.rotate_heads(positions, qk), rope.rotate(qk, *rope.cos_sin(positions)))


def test_kernel_with_no_k_heads():
    # rotate_heads' CUDA path: k has no heads, so only q's programs run.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 32, generator=gen)
    positions = torch.tensor([3, 1, 4, 1000])
    rope = RotaryEmbedding(inv_freq_for(32), 1.0)
    got_q, got_k = rotary(positions, x, x[:, :0], rope.inv_freq, 1.0, 32, False)
    assert got_k.shape == (4, 0, 32)
    torch.testing.assert_close(got_q, rope.rotate(x, *rope.cos_sin(positions)), atol=1e-5, rtol=1e-5)
