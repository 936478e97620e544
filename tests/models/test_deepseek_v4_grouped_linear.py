"""V4's grouped output projection (wo_a) over block-FP8 weights: one block-FP8 GEMM per group of heads where the
engine has that kernel (here the Triton kernel under the CPU interpreter, standing in for CUDA) gives the dequantized
batched GEMM's output; groups that cut a scale block keep the dequantized path."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.config.quantization import BlockFP8Config  # noqa: E402
from mlaserve.kernels.block_fp8 import block_fp8_linear  # noqa: E402
from mlaserve.layers.block_fp8 import quantize  # noqa: E402
from mlaserve.models import deepseek_v4_ffn as ffn  # noqa: E402
from mlaserve.models.deepseek_v4_ffn import GroupedLinear  # noqa: E402


def grouped(in_per_group: int, out_features: int, groups: int) -> GroupedLinear:
    layer = GroupedLinear(in_per_group, out_features, groups, BlockFP8Config(from_checkpoint=True))
    gen = torch.Generator().manual_seed(out_features)
    w, s = quantize(torch.randn(out_features, in_per_group, generator=gen) / in_per_group**0.5)
    layer.weight.data.copy_(w)
    layer.weight_scale_inv.data.copy_(s)
    return layer


@pytest.mark.parametrize("rows", [1, 20])
def test_one_fp8_gemm_per_group_gives_the_batched_dequantized_gemm(monkeypatch, rows):
    layer = grouped(192, 4 * 256, 4)  # 256 rows a group: two whole scale blocks
    x = torch.randn(rows, 4, 192, generator=torch.Generator().manual_seed(rows))
    want = layer(x)  # on CPU the engine has no block-FP8 kernel: the dequantized batched GEMM
    calls = []

    def kernel(*args: object, **options: object) -> torch.Tensor:
        calls.append(args[1].shape)
        return block_fp8_linear(*args, **options)

    monkeypatch.setattr(ffn, "BLOCK_FP8_LINEAR", SimpleNamespace(choose=lambda *args: kernel))
    got = layer(x)
    assert calls == [(256, 192)] * 4
    tol = 1e-4 if rows <= 16 else 3e-2  # past 16 rows the kernel quantizes x per token group (W8A8)
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_groups_that_cut_a_scale_block_stay_dequantized(monkeypatch):
    layer = grouped(128, 4 * 96, 4)
    monkeypatch.setattr(
        ffn, "BLOCK_FP8_LINEAR", SimpleNamespace(choose=lambda *args: pytest.fail("no kernel"))
    )
    assert layer(torch.randn(3, 4, 128)).shape == (3, 384)
