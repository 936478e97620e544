"""Block-FP8 linear kernels (kernels/block_fp8.py) against layers/block_fp8.py's torch reference, at widths that are
no multiple of a 128-wide block (the last block row and column partial), for one scale row per weight row
(group_n 1) and DeepSeek's 128-row blocks. A twin test: in CI it runs on the CPU interpreter at small sizes; on a
GPU (TRITON_INTERPRET=0, `-m twin`) natively, at larger ones too.

Decode batches (W8A16) are checked against linear_reference as is, larger ones (W8A8) against it with
quantize_activations=True; the activation quantization kernel is checked byte for byte."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.kernels.block_fp8 import block_fp8_linear  # noqa: E402
from mlaserve.kernels.fit import DEFAULT_SHARED_BYTES, GemmTile  # noqa: E402
from mlaserve.kernels.fp8_quant import quantize_per_token_group  # noqa: E402
from mlaserve.layers import block_fp8 as ref  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes, on_gpu  # noqa: E402

GPU = on_gpu()
DTYPES = kernel_test_dtypes()
SHAPES = [(80, 224), (200, 300)] + ([(2112, 1000), (576, 7168)] if GPU else [])  # (N, K)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def w8a8_tolerance(dtype: torch.dtype, want: torch.Tensor) -> dict[str, float]:
    """A float32 W8A8 GEMM on a GPU sums its fp8 products in the tensor cores' narrower accumulator, not in
    float32 as the reference (and the interpreter) does, so its error grows with the outputs' magnitude."""
    if GPU:
        accumulator = 2e-3 * want.abs().amax().item()
        return {"atol": max(accumulator, tolerance(dtype)), "rtol": max(1e-3, tolerance(dtype))}
    return {"atol": tolerance(dtype), "rtol": tolerance(dtype)}


def fp8_weight(n: int, k: int, group_n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight whose blocks span very different magnitudes, so a scale applied to the wrong block
    shows."""
    w = torch.randn(n, k, generator=gen, device=gen.device) * k**-0.5
    w *= torch.logspace(-1, 1, -(-k // 128), device=gen.device).repeat_interleave(128)[:k]
    return ref.quantize(w, block_n=group_n)


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(
    "rows, k, group", [(1, 224, 128), (19, 300, 128), (5, 200, 64)] + ([(3000, 7168, 128)] if GPU else [])
)
def test_act_quant_matches_the_reference_byte_for_byte(device, dtype, pow2, rows, k, group):  # fmt: skip
    """Values over twelve decades (e4m3 subnormals, ties, the clamp at FP8_MAX), signed zeros and an all-zero
    group: the same fp8 bytes and scales as torch's quantization."""
    gen = torch.Generator(device=device).manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen, device=device) * torch.logspace(-8, 4, k, device=device)
    x[0, :group] = 0.0
    x[-1, 1:5] = -0.0
    x = x.to(dtype)
    q, scale = quantize_per_token_group(x, group, pow2)
    want_q, want_scale = ref.quantize_per_token_group(x, group, pow2)
    assert q.dtype == ref.FP8 and q.shape == x.shape and scale.shape == want_scale.shape
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(bytes_of(q), bytes_of(want_q)), (bytes_of(q) != bytes_of(want_q)).nonzero()[:5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("rows", [1, 3, 5, 16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_decode_w8a16_matches_the_reference(device, dtype, group_n, rows, n, k):
    """Up to 16 rows x stays in its dtype: the GEMV to 4 rows, the 16-row tile kernel above."""
    gen = torch.Generator(device=device).manual_seed(rows * n + group_n)
    w, s = fp8_weight(n, k, group_n, gen)
    x = torch.randn(rows, k + 3, generator=gen, device=device)[:, 2 : 2 + k].to(dtype)  # a strided row slice
    bias = torch.randn(n, generator=gen, device=device).to(dtype) if rows % 2 else None
    got = block_fp8_linear(x, w, s, group_n, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = ref.linear_reference(x.float(), w, s, group_n, None if bias is None else bias.float())
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("rows", [40, 130] + ([1000] if GPU else []))
@pytest.mark.parametrize("fuse_quant", [False, True])
@pytest.mark.parametrize("n, k", SHAPES)
def test_prefill_w8a8_matches_the_quantized_reference(device, dtype, group_n, rows, fuse_quant, n, k):
    gen = torch.Generator(device=device).manual_seed(rows + n + group_n)
    w, s = fp8_weight(n, k, group_n, gen)
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    bias = torch.randn(n, generator=gen, device=device).to(dtype)
    got = block_fp8_linear(x, w, s, group_n, bias, fuse_quant=fuse_quant)
    # in float32: a bf16 reference would round each dequantized weight and activation to bf16 first
    want = ref.linear_reference(x.float(), w, s, group_n, bias.float(), quantize_activations=True)
    torch.testing.assert_close(got.float(), want, **w8a8_tolerance(dtype, want))


@pytest.mark.parametrize("fuse_quant", [False, True])
def test_prefill_with_power_of_two_scales(device, fuse_quant):
    gen = torch.Generator(device=device).manual_seed(2)
    w, s = fp8_weight(80, 300, 128, gen)
    x = torch.randn(33, 300, generator=gen, device=device)
    q, qs = ref.quantize_per_token_group(x, pow2_scale=True)
    want = F.linear(q.float() * qs.repeat_interleave(128, dim=-1)[:, :300], ref.dequantize(w, s, 128))
    got = block_fp8_linear(x, w, s, 128, fuse_quant=fuse_quant, pow2_scale=True)
    torch.testing.assert_close(got, want, **w8a8_tolerance(torch.float32, want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_decode_tile_down_the_ladder(device, dtype):
    """The 16-row tile kernel on each tile its ladder may fall back to (kernels/fit.py); each K step divides the
    128-wide scale column."""
    from mlaserve.kernels.fp8_decode import tile_for, tile_ladder

    gen = torch.Generator(device=device).manual_seed(5)
    n, k = 80, 300
    w, s = fp8_weight(n, k, 128, gen)
    x = torch.randn(7, k, generator=gen, device=device).to(dtype)
    want = ref.linear_reference(x.float(), w, s, 128)
    rungs = tile_ladder(tile_for(n), k, x.element_size(), DEFAULT_SHARED_BYTES)
    assert len(rungs) > 3 and all(128 % t.block_k == 0 for t in rungs)
    tol = tolerance(dtype)
    for tile in rungs:
        got = block_fp8_linear(x, w, s, 128, tile=tile)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(tile))


@pytest.mark.parametrize("fuse_quant", [False, True])
def test_every_prefill_tile_down_the_ladder(device, fuse_quant):
    """The W8A8 GEMM on each rung: K steps down to an fp8 dot's 32 (whole groups when it quantizes A itself), N
    down to 16, no pipelining; and the ladder starts lower where a tile would not fit."""
    from mlaserve.kernels.fp8_prefill import block_m_for, tile_ladder, w8a8_linear

    gen = torch.Generator(device=device).manual_seed(6)
    rows, n, k = 40, 200, 300
    w, s = fp8_weight(n, k, 1, gen)
    x = torch.randn(rows, k, generator=gen, device=device).half()
    want = ref.linear_reference(x, w, s, 1, quantize_activations=True).float()
    rungs = tile_ladder(block_m_for(rows), n, 2 if fuse_quant else 1, fuse_quant, DEFAULT_SHARED_BYTES)
    assert len(rungs) > 3 and all(128 % t.block_k == 0 and t.block_k >= 32 for t in rungs)
    for tile in rungs:
        out = torch.empty(rows, n, dtype=x.dtype, device=device)
        got = w8a8_linear(x, w, s, 1, None, out, fuse_quant, tiles=(tile,))
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2, msg=str(tile))
    fits = tile_ladder(128, n, 2, fuse_quant, 48 * 1024)[0]  # 128 16-bit rows quantized in a small budget
    assert fits.stages * fits.block_k * (2 * 128 + fits.block_n) <= 48 * 1024
    assert fits != tile_ladder(128, n, 2, fuse_quant, DEFAULT_SHARED_BYTES)[0]


def test_empty_batches_and_what_it_refuses(device):
    gen = torch.Generator(device=device).manual_seed(0)
    w, s = fp8_weight(80, 224, 128, gen)
    assert block_fp8_linear(torch.zeros(0, 224, device=device), w, s, 128).shape == (0, 80)
    with pytest.raises(ValueError, match="want \\(1, 2\\) float32"):
        block_fp8_linear(torch.zeros(2, 224, device=device), w, s[:, :1], 128)
    with pytest.raises(ValueError, match="group_n 64"):
        block_fp8_linear(torch.zeros(2, 224, device=device), w, s, 64)
    with pytest.raises(ValueError, match="must divide 128"):
        from mlaserve.kernels.fp8_prefill import w8a8_linear

        x = torch.zeros(20, 224, device=device)
        w8a8_linear(x, w, s, 128, None, torch.empty(20, 80, device=device), tiles=(GemmTile(64, 256, 4, 2),))
