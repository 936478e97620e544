"""Fused rotary position embedding for q and k as one Triton kernel, for CUDA.

In eager torch `RotaryEmbedding.forward` is about a dozen small kernels (position cast, outer product, cos, sin,
two scalings, slicing, the multiply-adds, the concatenations), each pure launch latency in a decode step with a
few tokens. Here one launch rotates every head of q and of k: each program takes one token and a block of heads of
either q or k, computes that token's cos/sin in registers and writes the rotated rows.

Output layout is the reference's (rotary.py) exactly, since the latent KV cache stores k as written and the torch
backend must read what the GPU path wrote: the first rotary_dim/2 features hold x1*cos - x2*sin, the next
rotary_dim/2 hold x2*cos + x1*sin (so interleaved pairs come out de-interleaved), features past rotary_dim are
copied through.

Numerics: the angle is positions.float() * inv_freq in fp32, as in the reference; cos/sin are scaled in fp32 and,
unlike the reference (which rounds cos/sin to x's dtype and does the multiply-adds in x's dtype), kept in fp32 with
the multiply-adds, so a bf16 output is rounded once. fp32 inputs agree with the reference to the last few ulps;
bf16 ones to within bf16 rounding. No host syncs: capturable in a CUDA graph.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def cos_sin(Pos, InvFreq, t, stride_pos, scaling, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """Token t's scaled cos and sin, [HALF_P2] in fp32 (zero past HALF)."""
    j = tl.arange(0, HALF_P2)
    # int -> fp32 first, then the fp32 product: the same two roundings as positions.float() * inv_freq.
    pos = tl.load(Pos + t * stride_pos).to(tl.float32)
    angle = pos * tl.load(InvFreq + j, mask=j < HALF, other=0.0)
    return tl.cos(angle) * scaling, tl.sin(angle) * scaling


@triton.jit
def rotated_halves(
    x_row, rows_ok, stride_d, cos, sin,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, ROWS: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """x_row: [ROWS, 1] pointers to rows (heads) of one token. Returns the rotated first and second halves in
    fp32, [ROWS, HALF_P2] each: x1*cos - x2*sin and x2*cos + x1*sin."""
    j = tl.arange(0, HALF_P2)
    mask = rows_ok[:, None] & (j < HALF)[None, :]
    if INTERLEAVED:
        # One contiguous [rows, 2 * pairs] load, split into even/odd features in registers: stride-2 loads
        # (or a [rows, pairs, 2] pointer tile) only vectorise to one or two elements.
        f = tl.arange(0, 2 * HALF_P2)
        tile_mask = rows_ok[:, None] & (f < 2 * HALF)[None, :]
        xy = tl.load(x_row + f[None, :] * stride_d, mask=tile_mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(xy, (ROWS, HALF_P2, 2)))
    else:
        x1 = tl.load(x_row + j[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (j + HALF)[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rotate_block(
    X, Out, head0, num_heads, stride_h, stride_d, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, REST_P2: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    # X and Out already point at this token's row; Out's rows are contiguous [num_heads, HEAD_DIM].
    heads = head0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF_P2)
    heads_ok = heads < num_heads
    mask = heads_ok[:, None] & (j < HALF)[None, :]
    x_row = X + heads[:, None] * stride_h
    o1, o2 = rotated_halves(x_row, heads_ok, stride_d, cos, sin, HALF, HALF_P2, BLOCK_H, INTERLEAVED)
    out_row = Out + heads[:, None] * HEAD_DIM
    dtype = Out.dtype.element_ty
    tl.store(out_row + j[None, :], o1.to(dtype), mask=mask)
    tl.store(out_row + HALF + j[None, :], o2.to(dtype), mask=mask)
    if REST_P2 > 0:  # partial rotary: the features past rotary_dim are copied as they are
        r = 2 * HALF + tl.arange(0, REST_P2)
        rest_mask = heads_ok[:, None] & (r < HEAD_DIM)[None, :]
        rest = tl.load(x_row + r[None, :] * stride_d, mask=rest_mask, other=0.0)
        tl.store(out_row + r[None, :], rest.to(dtype), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    Pos, InvFreq, Q, K, QOut, KOut,
    stride_pos, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    num_q_heads, num_k_heads, scaling,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, REST_P2: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)  # int64: t * row stride can pass 2**31 in a long prefill
    block = tl.program_id(1)
    cos, sin = cos_sin(Pos, InvFreq, t, stride_pos, scaling, HALF, HALF_P2)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_HQ)
    # q and k share the launch (and the cos/sin): the first q_blocks programs of a token take q's heads.
    if block < q_blocks:
        _rotate_block(
            Q + t * stride_qt, QOut + t * (num_q_heads * HEAD_DIM), block * BLOCK_HQ, num_q_heads,
            stride_qh, stride_qd, cos, sin, HEAD_DIM, HALF, HALF_P2, REST_P2, BLOCK_HQ, INTERLEAVED,
        )  # fmt: skip
    else:
        _rotate_block(
            K + t * stride_kt, KOut + t * (num_k_heads * HEAD_DIM), (block - q_blocks) * BLOCK_HK, num_k_heads,
            stride_kh, stride_kd, cos, sin, HEAD_DIM, HALF, HALF_P2, REST_P2, BLOCK_HK, INTERLEAVED,
        )  # fmt: skip


def _block_heads(num_heads: int, half_p2: int) -> int:
    # About 512 rotated pairs per program, one warp each: the fastest both for MLA's 128 heads of 64 and Llama's
    # heads of 128 (a prefill near the memory's bandwidth); bigger tiles left it at half that. Never more heads
    # than the tensor has (k in MLA has one).
    return max(1, min(triton.next_power_of_2(max(num_heads, 1)), 512 // half_p2))


def _num_warps(pairs: int) -> int:
    return max(1, min(4, pairs // 512))


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q ([T, Hq, D]) and k ([T, Hk, D]) at `positions` ([T]); see the module docstring.

    q and k may be strided views (a slice of a fused projection); the outputs are new contiguous tensors.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(
            f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} disagree"
        )
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or inv_freq.numel() != rotary_dim // 2:
        raise ValueError(
            f"rotary: rotary_dim {rotary_dim} with head_dim {head_dim}, {inv_freq.numel()} freqs"
        )
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(num_tokens, num_k_heads, head_dim, dtype=k.dtype, device=k.device)
    if num_tokens == 0:  # a zero-size grid is not a valid launch
        return q_out, k_out
    half = rotary_dim // 2
    half_p2 = triton.next_power_of_2(half)
    rest = head_dim - rotary_dim
    block_hq, block_hk = _block_heads(num_q_heads, half_p2), _block_heads(num_k_heads, half_p2)
    grid = (num_tokens, triton.cdiv(num_q_heads, block_hq) + triton.cdiv(num_k_heads, block_hk))
    _rotary_kernel[grid](
        positions, inv_freq.float().contiguous(), q, k, q_out, k_out,
        positions.stride(0), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        num_q_heads, num_k_heads, float(scaling),
        HEAD_DIM=head_dim, HALF=half, HALF_P2=half_p2, REST_P2=triton.next_power_of_2(rest) if rest else 0,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, INTERLEAVED=interleaved,
        num_warps=_num_warps(max(block_hq, block_hk) * half_p2),
    )  # fmt: skip
    return q_out, k_out
