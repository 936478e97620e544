"""The fp8_paths section's peers: other libraries' block-scaled FP8 GEMMs forced beside ours on the same block-FP8
linears (1x128 activation groups, 128x128 weight blocks), each only where it imports, with the reason kept where not.

- flashinfer_blockscale: FlashInfer's fp8_blockscale_gemm_sm90 (TensorRT-LLM's port of DeepGEMM's sm_90 kernel)
  through kernels/block_fp8.py's own forced path, so what is timed is what the table would run. It quantizes x
  itself and takes our weight scale as it is.
- deep_gemm_fp8: DeepGEMM's fp8_gemm_nt from the sgl-deep-gemm wheel (SGLang's build of DeepGEMM; the `deep_gemm`
  sdist on the registry cannot be built: it lacks its CUDA headers and CUTLASS). x goes through our per-token-group
  quantizer into the column-major scale layout DeepGEMM reads on sm_90, inside the timed call as in w8a8's; the
  weight scale is DeepGEMM's sm_90 layout already, so nothing is converted per call.

Each peer's first call of a shape builds its kernel (NVRTC or nvcc); the section's reference check makes that call,
untimed, before the CUDA graph is captured.

Getting them to the GPU machine (no network there): FlashInfer as ../shared/peers/flashinfer/README.md says, its
wheel given the GEMM's sources by dev/flashinfer_prefill_peer.py --kernels fp8_blockscale_gemm; DeepGEMM as the
prebuilt sgl-deep-gemm wheel, pinned to the release whose extension was linked against a torch of the GPU image's
generation (its later releases need a c10 symbol, CUDAErrorLogCapture, that newer torch releases added):

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        sgl-deep-gemm==0.2.0 -d .whl-peer
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

import torch

PEER_PATHS = ("flashinfer_blockscale", "deep_gemm_fp8")


def peer_call(path: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The forced call of peer `path` on x [M, K] and a weight [N, K] with 128x128 block scales s."""
    from mlaserve.kernels.block_fp8 import block_fp8_linear

    if path == "deep_gemm_fp8":
        return partial(deep_gemm_linear, x, w, s)
    return partial(block_fp8_linear, x, w, s, 128, path=path)


def deep_gemm_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x @ dequantize(w, s)^T in bf16 through DeepGEMM on sm_90, x quantized per token in groups of 128 first.
    Raises (the section keeps the message) where DeepGEMM cannot run: never imported off CUDA."""
    from mlaserve.kernels.fp8_quant import GROUP, quantize_per_token_group

    if not x.is_cuda or x.dtype != torch.bfloat16:
        raise ValueError(f"deep_gemm_fp8: needs bf16 x on a CUDA device, not {x.dtype} on {x.device.type}")
    deep_gemm = importlib.import_module("deep_gemm")
    a, a_scale = quantize_per_token_group(x, GROUP, column_major_scale=True)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
    deep_gemm.fp8_gemm_nt((a, a_scale), (w, s), out)
    return out


def peer_checks(device: torch.device) -> dict[str, str]:
    """Each peer's state on `device`, before any row: its version (and FlashInfer's one-time check), or why it is
    not measured."""
    from mlaserve.kernels.fp8_flashinfer import flashinfer_check, flashinfer_gemm

    checks = {}
    gemm = flashinfer_gemm()
    if isinstance(gemm, str):
        checks["flashinfer_blockscale"] = f"unavailable: {gemm}"
    else:
        flashinfer = importlib.import_module("flashinfer")
        checks["flashinfer_blockscale"] = (
            f"flashinfer {flashinfer.__version__}: {flashinfer_check(device, 128)}"
        )
    try:
        deep_gemm = importlib.import_module("deep_gemm")
        checks["deep_gemm_fp8"] = f"deep_gemm {getattr(deep_gemm, '__version__', 'of unknown version')}"
    except Exception as error:  # noqa: BLE001 - a peer that cannot load is a finding, not a reason to stop
        checks["deep_gemm_fp8"] = f"unavailable: {type(error).__name__}: {error}".splitlines()[0][:300]
    return checks
