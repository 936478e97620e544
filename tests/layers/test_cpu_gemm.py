"""The oneDNN-packed CPU linear against F.linear, and that loading a model packs its projections."""

import pytest
import torch
import torch.nn.functional as F

from mlaserve.layers import cpu_gemm
from mlaserve.layers.embedding import ParallelLMHead
from mlaserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(
    not cpu_gemm.can_pack(torch.empty(2, 2)), reason="this torch build has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 16, 37, 64, 65, 200])  # past MAX_ROWS: in slices
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    out_f, in_f = 96, 80
    weight = torch.randn(out_f, in_f, generator=g)
    bias = torch.randn(out_f, generator=g) if with_bias else None
    x = torch.randn(rows, in_f, generator=g)
    got = cpu_gemm.packed_linear(x, cpu_gemm.pack(weight), bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_keeps_leading_dims() -> None:
    weight, x = torch.randn(24, 16), torch.randn(3, 4, 16)
    got = cpu_gemm.packed_linear(x, cpu_gemm.pack(weight))
    assert got.shape == (3, 4, 24)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_only_float32_on_cpu_is_packed() -> None:
    assert cpu_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.pack(torch.randn(8)) is None


@needs_onednn
def test_layers_give_the_same_output_packed_and_plain() -> None:
    torch.manual_seed(0)
    layers = [MergedColumnParallelLinear(32, [48, 48], bias=True), RowParallelLinear(48, 32)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias)
        x = torch.randn(7, layer.in_features)
        plain = layer(x)
        layer.pack_weights()
        layer.pack_weights()  # a second call keeps the packed weight (the original is gone by then)
        assert layer.packed is not None
        torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    head = ParallelLMHead(100, 32)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(5, 32)
    plain = head.compute_logits(hidden)
    head.pack_weights()
    torch.testing.assert_close(head.compute_logits(hidden), plain, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_loading_a_float32_model_packs_its_linears(tmp_path) -> None:
    from mlaserve import LLM
    from mlaserve.testing.tiny_models import build_tiny

    path = build_tiny("llama", tmp_path / "llama")
    model = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64).engine.runner.model
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.packed is not None and attn.o_proj.packed is not None
    assert attn.qkv_proj.weight.numel() == 0  # packed layers hold their weight once
    assert model.lm_head.packed is not None
