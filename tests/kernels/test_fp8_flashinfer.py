"""FlashInfer's sm_90 block-scaled GEMM as a candidate of kernels/block_fp8.py's table (kernels/fp8_flashinfer.py):
it is never considered on CPU (FlashInfer is not even imported), an import that fails is kept as the reason, the
table leaves it off until FLASHINFER_MIN_ROWS is set and then sends it only the row counts in its range where it
can take the call (availability mocked here), and a forced path that cannot run says why. On an sm_90 GPU with
FlashInfer installed it is checked against the quantized reference."""

import types

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels import block_fp8, fp8_flashinfer  # noqa: E402
from mlaserve.kernels.block_fp8 import FLASHINFER_BLOCKSCALE, block_fp8_linear, dense_path  # noqa: E402
from mlaserve.layers import block_fp8 as ref  # noqa: E402
from mlaserve.testing.device import on_gpu  # noqa: E402
from tests.kernels.test_block_fp8 import fp8_weight  # noqa: E402


@pytest.fixture
def fresh_import(monkeypatch):
    """An empty import cache, so each test sees its own (mocked) FlashInfer."""
    monkeypatch.setattr(fp8_flashinfer, "_IMPORTED", {})
    return fp8_flashinfer


def test_on_cpu_it_declines_without_importing_flashinfer(fresh_import, monkeypatch):
    def no_import(name: str) -> None:
        raise AssertionError(f"imported {name}")

    monkeypatch.setattr(fresh_import.importlib, "import_module", no_import)
    w, _ = fp8_weight(128, 256, 128, torch.Generator().manual_seed(0))
    assert (
        fresh_import.flashinfer_blockscale_problem(torch.zeros(40, 256).bfloat16(), w, 128)
        == "needs a CUDA device"
    )
    assert fresh_import._IMPORTED == {}


def test_an_import_that_fails_is_the_reason_and_is_not_retried(fresh_import, monkeypatch):
    calls = []

    def broken(name: str) -> None:
        calls.append(name)
        raise ImportError("libcuda.so.1: cannot open shared object file\nmore")

    monkeypatch.setattr(fresh_import.importlib, "import_module", broken)
    why = "FlashInfer does not import: ImportError: libcuda.so.1: cannot open shared object file"
    assert fresh_import.flashinfer_gemm() == why and fresh_import.flashinfer_gemm() == why
    assert calls == ["flashinfer.gemm"]


def test_a_flashinfer_without_the_sm90_entry_point_is_refused(fresh_import, monkeypatch):
    monkeypatch.setattr(fresh_import.importlib, "import_module", lambda name: types.ModuleType(name))
    assert fresh_import.flashinfer_gemm() == "no fp8_blockscale_gemm_sm90"
    gemm = types.ModuleType("flashinfer.gemm")
    gemm.fp8_blockscale_gemm_sm90 = lambda *args, **kwargs: None
    monkeypatch.setattr(fresh_import, "_IMPORTED", {})
    monkeypatch.setattr(fresh_import.importlib, "import_module", lambda name: gemm)
    assert fresh_import.flashinfer_gemm() is gemm


def test_weights_with_a_scale_per_row_stay_on_ours(monkeypatch):
    """FlashInfer's kernel reads one weight scale per 128 rows, whatever scale shape its Python entry accepts."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    w, _ = fp8_weight(128, 256, 1, torch.Generator().manual_seed(0))
    why = fp8_flashinfer.flashinfer_blockscale_problem(torch.zeros(40, 256).bfloat16(), w, 1)
    assert why == "takes weight scales of 128x128 blocks only, not of 1 rows"


def test_usable_needs_both_the_shapes_and_the_check(monkeypatch):
    w, _ = fp8_weight(128, 256, 128, torch.Generator().manual_seed(0))
    x = torch.zeros(40, 256).bfloat16()
    assert block_fp8.flashinfer_usable(x, w, 128) == "needs a CUDA device"
    monkeypatch.setattr(block_fp8, "flashinfer_blockscale_problem", lambda *args: None)
    monkeypatch.setattr(block_fp8, "flashinfer_check", lambda device, group_n: "failed: relative error 0.5")
    assert block_fp8.flashinfer_usable(x, w, 128) == "failed: relative error 0.5"
    monkeypatch.setattr(block_fp8, "flashinfer_check", lambda device, group_n: "ok")
    assert block_fp8.flashinfer_usable(x, w, 128) is None


def test_the_table_sends_rows_to_flashinfer_only_once_turned_on(monkeypatch):
    w, _ = fp8_weight(128, 256, 128, torch.Generator().manual_seed(0))
    at = lambda rows, pow2=False: dense_path(torch.zeros(rows, 256), w, 128, pow2)  # noqa: E731
    monkeypatch.setattr(block_fp8, "TORCH_BLOCKWISE_MIN_ROWS", None)
    monkeypatch.setattr(block_fp8, "DEQUANT_MIN_ROWS", None)
    monkeypatch.setattr(block_fp8, "flashinfer_usable", lambda *args: None)  # as if installed and checked
    assert block_fp8.FLASHINFER_MIN_ROWS is None  # off by default
    assert (at(32), at(4096)) == ("w8a8", "w8a8")
    monkeypatch.setattr(block_fp8, "FLASHINFER_MIN_ROWS", 32)
    edge = block_fp8.W8A16_MAX_ROWS
    assert (at(edge), at(31), at(32), at(4096)) == (
        "w8a16",
        "w8a8",
        FLASHINFER_BLOCKSCALE,
        FLASHINFER_BLOCKSCALE,
    )
    assert at(32, pow2=True) == "w8a8"  # its activation scales are not powers of two
    monkeypatch.setattr(block_fp8, "FLASHINFER_MAX_ROWS", 512)
    assert (at(512), at(513)) == (FLASHINFER_BLOCKSCALE, "w8a8")
    monkeypatch.setattr(block_fp8, "FLASHINFER_MIN_ROWS", 1)
    monkeypatch.setattr(block_fp8, "FLASHINFER_MAX_ROWS", 8)
    assert (at(1), at(8), at(9)) == (
        FLASHINFER_BLOCKSCALE,
        FLASHINFER_BLOCKSCALE,
        "w8a16",
    )  # ahead of decode's too
    monkeypatch.setattr(block_fp8, "flashinfer_usable", lambda *args: "needs sm_90 (Hopper)")
    assert at(64) == "w8a8"  # ours is the fallback where it cannot take the call


def test_the_forced_path_runs_it_or_says_why(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    w, s = fp8_weight(128, 256, 128, gen)
    x = torch.randn(40, 256, generator=gen)
    with pytest.raises(ValueError, match="flashinfer_blockscale cannot take this call: needs a CUDA device"):
        block_fp8_linear(x, w, s, 128, path=FLASHINFER_BLOCKSCALE)
    monkeypatch.setattr(block_fp8, "flashinfer_usable", lambda *args: None)
    with pytest.raises(ValueError, match="never powers of two"):
        block_fp8_linear(x, w, s, 128, path=FLASHINFER_BLOCKSCALE, pow2_scale=True)
    seen = []

    def fake(
        x, weight, scale, bias, out
    ):  # the reference in FlashInfer's place: the call's arguments reach it
        seen.append((bias, out.shape))
        return out.copy_(ref.linear_reference(x, weight, scale, 128, bias, quantize_activations=True))

    monkeypatch.setattr(block_fp8, "flashinfer_blockscale_linear", fake)
    bias = torch.randn(128, generator=gen)
    got = block_fp8_linear(x, w, s, 128, bias=bias, path=FLASHINFER_BLOCKSCALE)
    assert got.shape == (40, 128) and seen[0][0] is bias and seen[0][1] == (40, 128)


@pytest.mark.skipif(not on_gpu(), reason="FlashInfer's GEMM runs on an sm_90 GPU only")
@pytest.mark.parametrize("rows", [8, 200])
def test_flashinfer_matches_the_quantized_reference(rows):
    group_n = 128
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w, s = fp8_weight(2112, 1024, group_n, gen)  # V3's fused_qkv_a width: a part 128-row scale block
    x = torch.randn(rows, 1024, generator=gen, device="cuda").bfloat16()
    why = block_fp8.flashinfer_usable(x, w, group_n)
    if why is not None:
        pytest.skip(f"FlashInfer's GEMM here: {why}")
    bias = torch.randn(2112, generator=gen, device="cuda").bfloat16()
    got = block_fp8_linear(x, w, s, group_n, bias=bias, path=FLASHINFER_BLOCKSCALE)
    want = ref.linear_reference(x, w, s, group_n, bias=bias, quantize_activations=True).float()
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
