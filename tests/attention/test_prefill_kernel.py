"""Which prefill kernel the backends run and name (the start-up log and stats()), without a GPU: the Triton varlen
kernel only once registry.TRITON_PREFILL_BY_DEFAULT is on, never with sinks; flash varlen's V padding named."""

import pytest
import torch

from mlaserve import LLM
from mlaserve.attention import sdpa
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.kernels import registry
from mlaserve.testing.tiny_models import build_tiny

CUDA, BF16 = torch.device("cuda"), torch.bfloat16
MLA_128 = (128, 128, 192, 128)  # heads, K/V heads, query/key width, value width


def test_off_by_default_flash_varlen_pads_v(monkeypatch):
    monkeypatch.setattr(sdpa, "_varlen_available", lambda: True)
    backend = SdpaBackend()
    assert backend.prefill_kernel(CUDA, BF16, *MLA_128, 0) == "torch flash varlen, V zero-padded to K's width"
    assert backend.prefill_kernel(CUDA, BF16, 8, 2, 64, 64, 0) == "torch flash varlen"
    assert backend.prefill_kernel(CUDA, torch.float32, *MLA_128, 0) == "SDPA per sequence"
    assert backend.prefill_kernel(torch.device("cpu"), BF16, *MLA_128, 0) == "SDPA per sequence"
    assert TorchBackend().prefill_kernel(CUDA, BF16, *MLA_128, 0) == "torch reference"


def test_triton_once_turned_on_but_not_with_sinks(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(sdpa, "_varlen_available", lambda: True)
    monkeypatch.setattr(registry, "TRITON_PREFILL_BY_DEFAULT", True)
    backend = SdpaBackend()
    triton = "triton varlen prefill (kernels/prefill_attn, V at its own width)"
    assert backend.prefill_kernel(CUDA, BF16, *MLA_128, 0) == triton
    assert (
        backend.prefill_kernel(CUDA, torch.float32, *MLA_128, 0) == triton
    )  # flash takes 16-bit only; this too
    assert backend.prefill_kernel(CUDA, BF16, *MLA_128, 4).startswith("SDPA")  # flash's window has no sinks
    assert backend.prefill_kernel(CUDA, BF16, 128, 128, 320, 128, 0) == "SDPA per sequence"  # wider than 256
    assert backend.prefill_kernel(torch.device("cpu"), BF16, *MLA_128, 0) == "SDPA per sequence"


def test_values_are_padded_only_for_flash():
    q = torch.zeros(3, 4, 24)
    meta = build_metadata(
        16, torch.zeros(1, 1, dtype=torch.int32), [3], [3], 0, torch.zeros(3, dtype=torch.long)
    )
    assert SdpaBackend().prefill_pads_values(q, 4, 16, meta) is False  # CPU: the SDPA loop takes V as it is
    assert TorchBackend().prefill_pads_values(q, 4, 16, meta) is False


def test_cpu_prefill_declines_the_triton_kernel_and_still_matches(monkeypatch):
    """Turned on, the kernel still declines CPU tensors: the backend's prefill stays the SDPA loop."""
    monkeypatch.setattr(registry, "TRITON_PREFILL_BY_DEFAULT", True)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(7, 2, 24, generator=gen),
        torch.randn(9, 2, 24, generator=gen),
        torch.randn(9, 2, 16),
    )
    table = torch.zeros(2, 1, dtype=torch.int32)
    meta = build_metadata(16, table, [3, 4], [5, 4], 0, torch.zeros(7, dtype=torch.long))
    got = SdpaBackend().prefill(q, k, v, meta, 0.3)
    torch.testing.assert_close(got, TorchBackend().prefill(q, k, v, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_stats_name_the_prefill_kernel(tmp_path):
    llm = LLM(str(build_tiny("deepseek_v3", tmp_path)), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.stats()["prefill_kernel"] == "SDPA per sequence"
