"""Prefill through torch's scaled_dot_product_attention (fused kernels on CPU and GPU); decode as the reference."""

import torch
import torch.nn.functional as F

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.torch_ref import TorchBackend, causal_mask


class SdpaBackend(TorchBackend):
    name = "sdpa"

    def prefill(self, q, k, v, meta: AttentionMetadata, scale: float):
        outs, q_start, k_start = [], 0, 0
        for q_len, kv_len in zip(meta.prefill_query_lens, meta.prefill_seq_lens):
            qi = q[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)
            ki = k[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            vi = v[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            if (
                ki.shape[1] != qi.shape[1]
            ):  # GQA: expand here rather than rely on enable_gqa (torch >= 2.5 only)
                groups = qi.shape[1] // ki.shape[1]
                ki, vi = ki.repeat_interleave(groups, 1), vi.repeat_interleave(groups, 1)
            if q_len == kv_len:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
            else:
                mask = causal_mask(q_len, kv_len, q.device)
                out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            outs.append(out.squeeze(0).transpose(0, 1))
            q_start, k_start = q_start + q_len, k_start + kv_len
        return torch.cat(outs)
