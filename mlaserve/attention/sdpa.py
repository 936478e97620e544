"""Prefill through torch's scaled_dot_product_attention (fused kernels on CPU and GPU); decode as the reference."""

import torch
import torch.nn.functional as F

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.torch_ref import TorchBackend, causal_mask, gather_decode


class SdpaBackend(TorchBackend):
    name = "sdpa"

    def decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, v_dim: int, need_lse: bool = False
    ):
        if need_lse:  # SDPA does not return the log-sum-exp
            return super().decode(q, k_cache, v_cache, meta, scale, v_dim, need_lse)
        b, h, dk = q.shape
        k = gather_decode(k_cache, meta, q.dtype).transpose(1, 2)  # [B, Hkv, L, Dk]
        v = k[..., :v_dim] if v_cache is None else gather_decode(v_cache, meta).transpose(1, 2)
        mask = meta.decode_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.view(b, h, 1, dk), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.view(b, h, v_dim), None

    def prefill(self, q, k, v, meta: AttentionMetadata, scale: float):
        outs, q_start, k_start = [], 0, 0
        for q_len, kv_len in zip(meta.prefill_query_lens, meta.prefill_seq_lens):
            qi = q[q_start : q_start + q_len].transpose(0, 1).unsqueeze(0)
            ki = k[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            vi = v[k_start : k_start + kv_len].transpose(0, 1).unsqueeze(0)
            if q_len == kv_len:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = causal_mask(q_len, kv_len, q.device)
                out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            outs.append(out.squeeze(0).transpose(0, 1))
            q_start, k_start = q_start + q_len, k_start + kv_len
        return torch.cat(outs)
