"""The dense block-FP8 paths besides the W8A16 and W8A8 kernels (kernels/block_fp8.py's table): the weight
dequantized on the device then cuBLAS (kernels/fp8_dequant.py, bit-exact against layers/block_fp8.dequantize),
torch's blockwise-scaled GEMM (kernels/fp8_torch.py: its scale layouts on CPU, the GEMM itself only on a GPU whose
one-time check passed), and which path each row count takes. A twin test, as tests/kernels/test_block_fp8.py."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels import block_fp8  # noqa: E402
from mlaserve.kernels.block_fp8 import block_fp8_linear, dense_path  # noqa: E402
from mlaserve.kernels.fp8_dequant import dequantize_weight  # noqa: E402
from mlaserve.kernels.fp8_quant import quantize_per_token_group  # noqa: E402
from mlaserve.kernels.fp8_torch import LAYOUTS, torch_blockwise_problem, weight_scale_for_torch  # noqa: E402
from mlaserve.layers import block_fp8 as ref  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes, on_gpu  # noqa: E402
from tests.kernels.test_block_fp8 import fp8_weight  # noqa: E402

GPU = on_gpu()
DTYPES = kernel_test_dtypes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("n, k", [(80, 224), (200, 300)])
def test_dequantize_weight_matches_the_reference_to_the_bit(device, dtype, group_n, n, k):
    gen = torch.Generator(device=device).manual_seed(n + group_n)
    w, s = fp8_weight(n, k, group_n, gen)
    got = dequantize_weight(w, s, group_n, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, ref.dequantize(w, s, group_n).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
def test_dequant_cublas_path_matches_the_reference(device, dtype, group_n):
    gen = torch.Generator(device=device).manual_seed(7)
    w, s = fp8_weight(200, 300, group_n, gen)
    x = torch.randn(40, 300, generator=gen, device=device).to(dtype)
    bias = torch.randn(200, generator=gen, device=device).to(dtype)
    got = block_fp8_linear(x, w, s, group_n, bias, path="dequant_cublas")
    want = ref.linear_reference(x.float(), w, s, group_n, bias.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_scales_for_cublas_lay_the_token_dimension_contiguous(device):
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(19, 300, generator=gen, device=device)
    q, s = quantize_per_token_group(x, column_major_scale=True)
    want_q, want_s = quantize_per_token_group(x)
    assert s.shape == (19, 3) and s.stride() == (1, 19)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_weight_scales_in_the_layouts_torch_asks_for():
    scale = torch.arange(2 * 3, dtype=torch.float32).view(2, 3)  # 2 row blocks, K of 3 groups
    plain = weight_scale_for_torch(scale, 128, "plain")
    padded = weight_scale_for_torch(scale, 128, "padded")
    assert plain.shape == padded.shape == (3, 2)
    assert torch.equal(plain, scale.t()) and torch.equal(padded, plain)
    assert plain.t().stride() == (3, 1) and padded.t().stride() == (4, 1)
    rows = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # one scale per weight row
    per_row = weight_scale_for_torch(rows, 1, "plain")
    assert torch.equal(per_row, rows.t()) and per_row.t().stride() == (1, 5)
    # scaled_mm with named recipes: 128x128 as [round_up(K/128, 4), N/128] with stride [1, that], 1x128 as
    # [N, K/128] with stride [1, N] (torch's own shape checks for those recipes)
    whole = weight_scale_for_torch(scale, 128, "padded_full")
    assert whole.shape == (4, 2) and whole.stride() == (1, 4) and torch.equal(whole[:3], scale.t())
    assert weight_scale_for_torch(scale, 128, "recipes").shape == (4, 2)
    named = weight_scale_for_torch(rows, 1, "recipes")
    assert torch.equal(named, rows) and named.stride() == (1, 5)


def test_each_row_count_takes_its_path(monkeypatch):
    w, s = fp8_weight(80, 256, 128, torch.Generator().manual_seed(0))
    at = lambda rows: dense_path(torch.zeros(rows, 256), w, 128)  # noqa: E731
    edge = block_fp8.W8A16_MAX_ROWS
    assert (at(1), at(edge), at(edge + 1)) == ("w8a16", "w8a16", "w8a8")
    monkeypatch.setattr(block_fp8, "TORCH_BLOCKWISE_MIN_ROWS", 32)
    monkeypatch.setattr(block_fp8, "DEQUANT_MIN_ROWS", None)
    assert at(4096) == "w8a8"  # on CPU torch's blockwise GEMM declines
    monkeypatch.setattr(block_fp8, "DEQUANT_MIN_ROWS", 64)
    assert (at(63), at(64)) == ("w8a8", "dequant_cublas")


def test_forced_paths_that_cannot_take_a_call_say_why():
    w, s = fp8_weight(80, 256, 128, torch.Generator().manual_seed(0))
    assert torch_blockwise_problem(torch.zeros(32, 256).bfloat16(), w, 128) == "needs a CUDA device"
    with pytest.raises(ValueError, match="torch_blockwise cannot take this call: needs a CUDA device"):
        block_fp8_linear(torch.zeros(32, 256), w, s, 128, path="torch_blockwise")
    with pytest.raises(ValueError, match="path 'fast'"):
        block_fp8_linear(torch.zeros(17, 256), w, s, 128, path="fast")


@pytest.mark.skipif(not GPU, reason="torch's blockwise GEMM runs on CUDA only")
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("rows", [32, 1000])
def test_torch_blockwise_path_matches_the_quantized_reference(group_n, rows):
    from mlaserve.kernels.fp8_torch import blockwise_check

    gen = torch.Generator(device="cuda").manual_seed(rows)
    w, s = fp8_weight(2176, 1024, group_n, gen)  # N in whole 128-row blocks, as 128x128 scaling needs
    x = torch.randn(rows, 1024, generator=gen, device="cuda").bfloat16()
    check = blockwise_check(x.device, group_n)
    if check not in LAYOUTS:
        pytest.skip(f"torch's blockwise GEMM on this GPU: {check}")
    got = block_fp8_linear(x, w, s, group_n, path="torch_blockwise")
    want = ref.linear_reference(x, w, s, group_n, quantize_activations=True).float()
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_n", [1, 128])
@pytest.mark.parametrize("rows", [17, 40, 130])
def test_w8a16_past_one_tile_matches_the_reference(device, dtype, group_n, rows):
    """The decode tile kernel in 32- and 64-row tiles, several row blocks: x as is, so the unquantized reference."""
    gen = torch.Generator(device=device).manual_seed(rows + group_n)
    w, s = fp8_weight(200, 300, group_n, gen)
    x = torch.randn(rows, 300, generator=gen, device=device).to(dtype)
    bias = torch.randn(200, generator=gen, device=device).to(dtype)
    got = block_fp8_linear(x, w, s, group_n, bias, path="w8a16")
    want = ref.linear_reference(x.float(), w, s, group_n, bias.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
