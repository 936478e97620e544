"""On a GPU (skipped in CI): the fused MLA cache write in bf16 with bf16, fp8 and int8 caches against the torch
path on the CPU, at DeepSeek-V2's widths (512 + 64, 16 heads of 128 + 64)."""

import pytest
import torch

from mlaserve.kernels.mla_prep import mla_prep
from mlaserve.kvcache.quant import TAIL_BYTES, dequantize_rows
from tests.kernels.test_mla_prep import inputs, tiny_mla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_mla_prep_on_gpu_matches_torch_path(cache_dtype):
    t, heads, lora, nope, rope = 37, 16, 512, 128, 64
    gen = torch.Generator().manual_seed(3)
    layer = tiny_mla(heads, lora, nope, rope, True, 1.1).to(torch.bfloat16)
    q, kv, positions = inputs(gen, t, heads, lora, nope, rope, torch.bfloat16)
    slots = torch.randperm(64, generator=gen)[:t]
    width = lora + rope + (TAIL_BYTES if cache_dtype.itemsize == 1 else 0)
    cache = torch.zeros(16, 4, 1, width, dtype=torch.uint8 if cache_dtype.itemsize == 1 else cache_dtype)
    cache = cache.view(cache_dtype)
    q_ref, cache_ref = q.clone(), cache.clone()
    layer.rope_and_cache(positions, q_ref, kv, cache_ref, slots)
    q_gpu, cache_gpu = q.cuda(), cache.cuda()
    norm, rotary = layer.kv_a_layernorm, layer.rotary
    mla_prep(positions.cuda(), q_gpu, kv.cuda(), norm.weight.cuda(), norm.eps, rotary.inv_freq.cuda(),
             rotary.scaling, True, cache_gpu, slots.cuda())  # fmt: skip
    torch.testing.assert_close(q_gpu.cpu().float(), q_ref.float(), atol=2e-2, rtol=2e-2)
    got, want = cache_gpu.cpu().view(64, width)[slots], cache_ref.view(64, width)[slots]
    if cache_dtype.itemsize == 1:
        got, want = dequantize_rows(got, torch.float32), dequantize_rows(want, torch.float32)
        scale = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= 0.08 * scale).all()  # within one 8-bit step of the row's scale
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
