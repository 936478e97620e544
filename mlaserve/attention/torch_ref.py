"""Plain torch attention over the paged cache: the ground truth every faster backend is tested against."""

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import AttentionMetadata, causal_mask
from mlaserve.kvcache.quant import dequantize_rows, is_quantized


def gather_decode(
    cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Each decode sequence's context from the paged cache, padded: [num_decodes, max_len, Hkv, D]; 8-bit
    latent rows come back dequantized to `dtype`."""
    index = meta.decode_slot_index
    rows = cache.flatten(0, 1).index_select(0, index.reshape(-1))  # far cheaper than advanced indexing
    rows = rows.view(*index.shape, *cache.shape[2:])
    return dequantize_rows(rows, dtype) if is_quantized(cache.dtype) else rows


class TorchBackend(AttentionBackend):
    name = "torch"
    decode_kernel_name = "torch reference"

    def decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, v_dim: int, need_lse: bool = False
    ):
        k = gather_decode(k_cache, meta, q.dtype)  # [B, L, Hkv, Dk]
        v = k[..., :v_dim] if v_cache is None else gather_decode(v_cache, meta)
        b, h, dk = q.shape
        hkv = k.shape[2]
        qg = q.view(b, hkv, h // hkv, dk).float()
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale
        scores.masked_fill_(~meta.decode_mask[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
        return out.reshape(b, h, v_dim).to(q.dtype), lse.reshape(b, h)

    def prefill(self, q, k, v, meta: AttentionMetadata, scale: float):
        outs, q_start, k_start = [], 0, 0
        for j, (q_len, kv_len) in enumerate(zip(meta.prefill_query_lens, meta.prefill_seq_lens)):
            qi = q[q_start : q_start + q_len].float().transpose(0, 1)  # [H, q, D]
            ki = k[k_start : k_start + kv_len].float().transpose(0, 1)
            vi = v[k_start : k_start + kv_len].float().transpose(0, 1)
            groups = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
            scores = (qi @ ki.transpose(1, 2)) * scale
            mask = meta.prefill_mask(j, q.device)
            scores.masked_fill_(
                ~(causal_mask(q_len, kv_len, q.device) if mask is None else mask), float("-inf")
            )
            outs.append((scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype))
            q_start, k_start = q_start + q_len, k_start + kv_len
        return torch.cat(outs)
