"""The fused MLA cache-write kernel against MLAAttention.rope_and_cache's torch path, under TRITON_INTERPRET=1."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.kernels.mla_prep import mla_prep  # noqa: E402
from mlaserve.kvcache.quant import TAIL_BYTES, quantize_rows  # noqa: E402
from mlaserve.layers.mla import MLAAttention  # noqa: E402
from mlaserve.parallel import ParallelContext  # noqa: E402


def tiny_mla(heads: int, lora: int, nope: int, rope: int, interleaved: bool, scaling: float) -> MLAAttention:
    cfg = SimpleNamespace(
        num_attention_heads=heads, kv_lora_rank=lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
        v_head_dim=nope, hidden_size=32, rms_norm_eps=1e-6, q_lora_rank=None, rope_theta=10000.0,
        rope_interleave=interleaved,
    )  # fmt: skip
    layer = MLAAttention(cfg, TorchBackend(), ParallelContext())
    layer.rotary.scaling = scaling  # as YaRN's attention scaling would set it
    with torch.no_grad():
        layer.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    return layer


def inputs(gen, t: int, heads: int, lora: int, nope: int, rope: int, dtype: torch.dtype):
    q = torch.randn(t, heads, nope + rope, generator=gen).to(dtype)
    kv = torch.randn(t, lora + rope + 9, generator=gen)[:, 4 : 4 + lora + rope].to(dtype)  # a strided slice
    positions = torch.randint(0, 4000, (t,), generator=gen)
    return q, kv, positions


CASES = [
    # tokens, heads, kv_lora_rank, nope, rope, interleaved, scaling, dtype
    (5, 4, 32, 16, 16, True, 1.0, torch.float32),
    (3, 3, 48, 8, 16, False, 1.3, torch.float32),  # non-power-of-two latent and head count, NeoX rope
    (6, 16, 64, 32, 16, True, 0.9, torch.bfloat16),
    (1, 2, 32, 16, 8, True, 1.0, torch.float16),
]


@pytest.mark.parametrize("t,heads,lora,nope,rope,interleaved,scaling,dtype", CASES)
def test_kernel_matches_torch_path(t, heads, lora, nope, rope, interleaved, scaling, dtype) -> None:
    gen = torch.Generator().manual_seed(t * 100 + heads)
    layer = tiny_mla(heads, lora, nope, rope, interleaved, scaling).to(dtype)
    q, kv, positions = inputs(gen, t, heads, lora, nope, rope, dtype)
    cache = torch.randn(4, 4, 1, lora + rope, generator=gen).to(
        dtype
    )  # rows not written must stay as they are
    slots = torch.randperm(16, generator=gen)[:t]

    q_ref, cache_ref = q.clone(), cache.clone()
    layer.rope_and_cache(positions, q_ref, kv, cache_ref, slots)  # CPU tensors: the torch path
    q_out, cache_out = q.clone(), cache.clone()
    w = layer.kv_a_layernorm.weight
    mla_prep(positions, q_out, kv, w, 1e-6, layer.rotary.inv_freq, scaling, interleaved, cache_out, slots)

    # Same rounding points; bf16/fp16 differ only where the reference rounds cos/sin to the input dtype first.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q_out[..., :nope], q[..., :nope], rtol=0, atol=0)  # nope part untouched
    torch.testing.assert_close(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(cache_out.float(), cache_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_8bit_rows_are_quantize_rows_of_the_16bit_rows(cache_dtype: torch.dtype) -> None:
    """Quantizing in the kernel gives the bytes quantize_rows gives for the kernel's own unquantized row."""
    t, heads, lora, nope, rope = 7, 4, 64, 16, 32
    gen = torch.Generator().manual_seed(7)
    layer = tiny_mla(heads, lora, nope, rope, True, 1.0).to(torch.bfloat16)
    q, kv, positions = inputs(gen, t, heads, lora, nope, rope, torch.bfloat16)
    kv = kv * 3.0
    slots = torch.randperm(16, generator=gen)[:t]
    args = (layer.kv_a_layernorm.weight, 1e-6, layer.rotary.inv_freq, 1.0, True)
    wide = torch.zeros(4, 4, 1, lora + rope, dtype=torch.bfloat16)
    mla_prep(positions, q.clone(), kv, *args, wide, slots)
    narrow = torch.full((4, 4, 1, lora + rope + TAIL_BYTES), 3, dtype=torch.uint8).view(cache_dtype)
    mla_prep(positions, q.clone(), kv, *args, narrow, slots)
    expected = quantize_rows(wide.view(16, lora + rope)[slots], cache_dtype)
    got = narrow.view(16, -1)[slots]
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (narrow.view(torch.uint8).view(16, -1)[untouched] == 3).all()


def test_rejects_mismatched_cache_rows() -> None:
    layer = tiny_mla(2, 32, 16, 16, True, 1.0)
    q, kv, positions = inputs(torch.Generator().manual_seed(0), 2, 2, 32, 16, 16, torch.float32)
    cache = torch.zeros(2, 4, 1, 40)
    with pytest.raises(ValueError, match="cache rows 40"):
        mla_prep(positions, q, kv, layer.kv_a_layernorm.weight, 1e-6, layer.rotary.inv_freq, 1.0, True, cache,
                 torch.arange(2))  # fmt: skip
