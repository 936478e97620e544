"""Prefill through torch's fused attention kernels (flash varlen on CUDA, scaled_dot_product_attention
elsewhere), or our Triton varlen kernel (kernels/prefill_attn: V at its own width) once registry.py's
TRITON_PREFILL_BY_DEFAULT is on; decode as the reference, or SDPA when no LSE is needed.

cuDNN's attention, which SDPA prefers on Hopper, builds an execution plan for every new shape, a long
host-side pause each time, and chunked prefill makes new shapes all the time. So on CUDA one varlen flash call covers every
prefill sequence, and SDPA calls exclude cuDNN.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlaserve.attention.metadata import AttentionMetadata, causal_mask
from mlaserve.attention.torch_ref import TorchBackend, gather_decode
from mlaserve.kernels import registry

_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _kernels(device: torch.device) -> contextlib.AbstractContextManager:
    return sdpa_kernel(_NO_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


def varlen_prefill(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Every prefill sequence in one flash-attention call, bottom-right causal.

    The aten op under torch.nn.attention.varlen.varlen_attn, called directly: that wrapper is a Python custom op
    that also logs and allocates an RNG-state tensor on every call, host time per layer that a short prefill's
    GPU waited for."""
    heads, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]
    if k.shape[1] != heads:  # GQA: flash's varlen entry point takes equal head counts
        k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    if dv != dk:  # flash needs one head size for K and V (MLA: 192 vs 128); zero columns change nothing
        v = F.pad(v, (0, dk - dv))
    out = torch.ops.aten._flash_attention_forward(
        q, k.contiguous(), v.contiguous(), meta.prefill_cu_query_lens, meta.prefill_cu_seq_lens,
        max(meta.prefill_query_lens), max(meta.prefill_seq_lens), 0.0, True, False,
        scale=scale, window_size_left=-1 if meta.window is None else meta.window - 1, window_size_right=0,
    )[0]  # fmt: skip
    return out[..., :dv]


@functools.cache
def _varlen_available() -> bool:
    # A right window of 0 is how the call above asks for bottom-right causal masks (chunks that attend to context);
    # a torch whose flash op lacks the window arguments takes the per-sequence SDPA loop instead.
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return "window_size_left" in schema


def varlen_takes(device: torch.device, dtype: torch.dtype, qk_dim: int) -> bool:
    """Whether torch's flash varlen op takes queries of this dtype and width on `device`."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and qk_dim <= 256
        and _varlen_available()
    )


def can_use_varlen(q: torch.Tensor) -> bool:
    return varlen_takes(q.device, q.dtype, q.shape[-1])


def triton_prefill_runs(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, qk_dim: int, v_dim: int, sinks: int
) -> bool:
    """Whether SdpaBackend.prefill takes the Triton kernel for this shape: what registry.PREFILL_ATTENTION.choose
    answers for such tensors (flash's window and the kernel's have no sinks)."""
    return (
        not sinks
        and registry.prefill_attention_problem(device, dtype, heads, kv_heads, qk_dim, v_dim) is None
        and registry.prefill_attention_pays()
        and registry.PREFILL_ATTENTION.launch.load() is not None
    )


class SdpaBackend(TorchBackend):
    name = "sdpa"
    decode_kernel_name = "sdpa (paged torch decode)"

    def decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, v_dim: int, need_lse: bool = False
    ):
        if need_lse:  # SDPA does not return the log-sum-exp
            return super().decode(q, k_cache, v_cache, meta, scale, v_dim, need_lse)
        b, h, dk = q.shape
        k = gather_decode(k_cache, meta, q.dtype).transpose(1, 2)  # [B, Hkv, L, Dk]
        v = k[..., :v_dim] if v_cache is None else gather_decode(v_cache, meta).transpose(1, 2)
        mask = meta.decode_mask[:, None, None, :]
        with _kernels(q.device):
            out = F.scaled_dot_product_attention(
                q.view(b, h, 1, dk), k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out.view(b, h, v_dim), None

    def prefill_kernel(
        self,
        device: torch.device,
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        qk_dim: int,
        v_dim: int,
        sinks: int,
    ) -> str:
        if triton_prefill_runs(device, dtype, heads, kv_heads, qk_dim, v_dim, sinks):
            return "triton varlen prefill (kernels/prefill_attn, V at its own width)"
        if varlen_takes(device, dtype, qk_dim) and not sinks:
            padded = ", V zero-padded to K's width" if v_dim < qk_dim else ""
            return f"torch flash varlen{padded}"
        return "SDPA per sequence"

    def prefill_pads_values(
        self, q: torch.Tensor, kv_heads: int, v_dim: int, meta: AttentionMetadata
    ) -> bool:
        # flash varlen takes one head size; the Triton kernel and the SDPA loop take V as it is
        triton = triton_prefill_runs(q.device, q.dtype, q.shape[1], kv_heads, q.shape[-1], v_dim, meta.sinks)
        return can_use_varlen(q) and not meta.sinks and not triton

    def prefill(self, q, k, v, meta: AttentionMetadata, scale: float):
        if not meta.sinks:
            kernel = registry.PREFILL_ATTENTION.choose(q, k, v)
            if kernel is not None:
                cu_q, cu_k = meta.prefill_cu_query_lens, meta.prefill_cu_seq_lens
                return kernel(q, k, v, cu_q, cu_k, scale, meta.window)[0]
        if can_use_varlen(q) and not meta.sinks:  # flash's window has no sinks
            return varlen_prefill(q, k, v, meta, scale)
        outs, q_start, k_start = [], 0, 0
        for j, (q_len, kv_len) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
            qi = q[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)
            ki = k[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            vi = v[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            with _kernels(q.device):
                if q_len == kv_len and meta.window is None:
                    out = F.scaled_dot_product_attention(
                        qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                    )
                else:
                    mask = meta.prefill_mask(j, q.device)
                    mask = causal_mask(q_len, kv_len, q.device) if mask is None else mask
                    out = F.scaled_dot_product_attention(
                        qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
                    )
            outs.append(out.squeeze(0).transpose(0, 1))
            q_start, k_start = q_start + q_len, k_start + kv_len
        return torch.cat(outs)
