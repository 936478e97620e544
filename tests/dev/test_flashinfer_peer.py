"""dev/flashinfer_prefill_peer.py picks the sources each peer kernel needs from the original FlashInfer wheel (the
batch-prefill files by default, as before; the FP8 block-scaled GEMM's binding and TensorRT-LLM tree on request),
and rewrites a wheel with them added, compressed and listed in RECORD."""

import argparse
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))

import flashinfer_prefill_peer as peer  # noqa: E402

C = peer.CSRC
PREFILL = C + "batch_prefill.cu"
FP8 = (
    C + "fp8_blockscale_gemm_sm90_binding.cu",
    C + "fused_moe/cutlass_backend/deepgemm_jit_setup.cu",
    C + "nv_internal/tensorrt_llm/deep_gemm/fp8_gemm_impl.cuh",
    C + "nv_internal/cpp/common/logger.cpp",
)
OTHER = (C + "fused_moe/other.cu", C + "batch_mla_run.cu", "flashinfer/gemm/gemm_base.py", C + "nv_internal/")


def test_each_kernel_wants_its_own_sources():
    assert peer.wanted(PREFILL) and not any(peer.wanted(n) for n in FP8)  # the default: prefill, as before
    both = ("prefill", "fp8_blockscale_gemm")
    assert all(peer.wanted(n, both) for n in (PREFILL, *FP8))
    assert not any(peer.wanted(n, both) for n in OTHER)
    assert not peer.wanted(PREFILL, ("fp8_blockscale_gemm",))


def test_kernel_names_are_checked():
    assert peer.parse_kernels("prefill,fp8_blockscale_gemm") == ("prefill", "fp8_blockscale_gemm")
    with pytest.raises(argparse.ArgumentTypeError, match="fp8_gemm"):
        peer.parse_kernels("fp8_gemm")


def test_the_wheel_is_rewritten_with_the_sources_added(tmp_path):
    record = "flashinfer_python-0.dist-info/RECORD"
    original, slim = tmp_path / "orig.whl", tmp_path / "slim.whl"
    with zipfile.ZipFile(original, "w") as z:
        for name in (PREFILL, *FP8, *OTHER[:3]):
            z.writestr(name, "x" * 4000)
    with zipfile.ZipFile(slim, "w") as z:
        z.writestr("flashinfer/__init__.py", "")
        z.writestr(record, "flashinfer/__init__.py,sha256=abc,0\n" + record + ",,\n")
    assert peer.add_sources(str(slim), str(original), ("fp8_blockscale_gemm",), str(tmp_path)) == len(FP8)
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        assert names == {"flashinfer/__init__.py", record, *FP8}
        assert all(z.getinfo(n).compress_type == zipfile.ZIP_DEFLATED for n in FP8)
        listed = [line.split(",")[0] for line in z.read(record).decode().splitlines()]
    assert sorted(listed) == sorted(["flashinfer/__init__.py", *FP8, record])
