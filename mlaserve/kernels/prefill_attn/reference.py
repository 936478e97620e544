"""Varlen causal prefill attention in plain torch: the Triton kernel's reference, in float32, one sequence at a time.

Sequence b's queries are q[cu_q[b]:cu_q[b+1]] and its keys and values k, v[cu_k[b]:cu_k[b+1]]; its queries are the
last of its keys' positions (bottom-right causal: a chunk sees its cached prefix and the causal part of itself).
With a window W, query position p sees keys p - W + 1 .. p.
"""

import torch


def visible(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] True where query j (position kv_len - q_len + j) may see key i."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    mask = keys <= q_pos
    if window is not None:
        mask &= keys > q_pos - window
    return mask


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, Dqk], k [S, Hkv, Dqk], v [S, Hkv, Dv] (H a multiple of Hkv) -> (out [T, H, Dv] in q's dtype, the
    natural-log LSE of each row's scaled scores [T, H] float32, or None)."""
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], num_heads, dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0:
            continue
        qi = q[q0:q1].float().transpose(0, 1)  # [H, q, D]
        ki = k[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)
        vi = v[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = (qi @ ki.transpose(1, 2)) * scale
        scores.masked_fill_(~visible(q1 - q0, k1 - k0, window, q.device), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, q]
        out[q0:q1] = (torch.exp(scores - row_lse[..., None]) @ vi).transpose(0, 1).to(q.dtype)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, (lse if return_lse else None)
