"""MXFP4 as DeepSeek-V4 stores its experts: the byte layout (low nibble first, e8m0 scales per 32 inputs) decoded
by hand, quantization's round trip, and the MXFP4 experts against V4's SwiGLU experts on the dequantized weights."""

import pytest
import torch
from torch import nn

from mlaserve.layers import mxfp4
from mlaserve.layers.mxfp4_experts import MXFP4Experts, experts_reference
from mlaserve.models.deepseek_v4_ffn import V4MLP, run_experts


def test_every_code_decodes_to_its_e2m1_value_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).view(1, 16)  # byte i: code i low, code 15 - i high
    values = mxfp4.unpack(packed)[0]
    want = torch.tensor(mxfp4.E2M1_VALUES)
    assert torch.equal(values[0::2], want)
    assert torch.equal(values[1::2], want.flip(0))
    assert mxfp4.E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_each_scale_byte_is_a_power_of_two_over_its_32_columns():
    packed = torch.full((2, 32), 0x21, dtype=torch.uint8)  # every pair: 0.5 then 1.0
    scales = torch.tensor([[127, 130], [120, 127]], dtype=torch.uint8)
    w = mxfp4.dequantize(packed, scales)
    assert w.shape == (2, 64)
    assert w[0, :32].tolist() == [0.5, 1.0] * 16
    assert w[0, 32:].tolist() == [4.0, 8.0] * 16  # 2^3
    assert w[1, :2].tolist() == [0.5 * 2**-7, 2**-7]


def test_checkpoint_dtypes_are_read_as_their_bits():
    """int8 / float4_e2m1fn_x2 bytes and float8_e8m0fnu scales, as safetensors hands them over."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (4, 1), dtype=torch.uint8, generator=gen)
    want = mxfp4.dequantize(packed, scales)
    assert torch.equal(mxfp4.dequantize(packed.view(torch.int8), scales.view(torch.float8_e8m0fnu)), want)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(mxfp4.dequantize(packed.view(torch.float4_e2m1fn_x2), scales), want)
    assert torch.equal(scales.view(torch.float8_e8m0fnu).float(), mxfp4.scale_values(scales))


def test_quantize_round_trip():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 96, generator=gen) * torch.logspace(-3, 1, 96)
    packed, scales = mxfp4.quantize(w)
    assert packed.shape == (24, 48) and scales.shape == (24, 3)
    back = mxfp4.dequantize(packed, scales)
    # e2m1's widest step is 2 (between 4 and 6): at most 1 x scale away, and the scale is at most amax / 3
    step = mxfp4.scale_values(scales).repeat_interleave(32, dim=-1)
    assert ((back - w).abs() <= step + 1e-12).all()
    again = mxfp4.quantize(back)  # representable values survive exactly
    assert torch.equal(mxfp4.dequantize(*again), back)
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp4.quantize(torch.randn(4, 40))


def _experts(num: int = 6, hidden: int = 64, inter: int = 32, limit: float = 1.5):
    gen = torch.Generator().manual_seed(2)
    fp4 = MXFP4Experts(num, hidden, inter, limit)
    ref = nn.ModuleList(V4MLP(hidden, inter, limit) for _ in range(num))
    with torch.no_grad():
        for e, mlp in enumerate(ref):
            for which, proj in enumerate((mlp.w1, mlp.w3)):
                packed, scales = mxfp4.quantize(torch.randn(inter, hidden, generator=gen))
                fp4.w13[e, which * inter : (which + 1) * inter] = packed
                fp4.w13_scale[e, which * inter : (which + 1) * inter] = scales
                proj.weight.copy_(mxfp4.dequantize(packed, scales))
            packed, scales = mxfp4.quantize(torch.randn(hidden, inter, generator=gen) * 0.2)
            fp4.w2[e], fp4.w2_scale[e] = packed, scales
            mlp.w2.weight.copy_(mxfp4.dequantize(packed, scales))
    return fp4, ref


def test_mxfp4_experts_equal_v4_experts_on_the_dequantized_weights():
    fp4, ref = _experts()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    with torch.no_grad():
        want = run_experts(ref, x, ids, weights)
        torch.testing.assert_close(fp4(x, ids, weights), want, rtol=1e-5, atol=1e-5)
        every = experts_reference(
            x, fp4.w13, fp4.w13_scale, fp4.w2, fp4.w2_scale, ids, weights, fp4.limit, every_expert=True
        )
        torch.testing.assert_close(every, want, rtol=1e-5, atol=1e-5)


def test_widths_off_the_scale_groups_are_refused():
    with pytest.raises(ValueError, match="moe_intermediate_size to be a multiple of 32"):
        MXFP4Experts(4, 64, 48, 1.0)
