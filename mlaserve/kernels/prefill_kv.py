"""The expanded prefill's keys and values in one Triton pass, for CUDA.

MLA's prefill up-projects each context row's latent to per-head k_nope and v (kv_b_proj), and every head's key is
[k_nope | the row's one shared rope key]. Flash attention's varlen call then wants K and V contiguous and of one
head size, so V is zero-padded to K's width. In torch that is a concatenation with a broadcast input, then F.pad's
copy, which took several times what their bytes cost in long prefill steps. Here one
program writes a block of (row, head) pairs of both: K and V padded with zeros, or V at its own width for an
attention kernel that takes it so (kernels/prefill_attn). `prefill_kv_reference` is the torch path it is tested
against.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _prefill_kv_kernel(
    KV, KPe, K, V, pairs, num_heads, stride_kv_s, stride_kv_h, stride_pe,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, WIDTH: tl.constexpr, V_WIDTH: tl.constexpr,
    NOPE_P2: tl.constexpr, ROPE_P2: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (row, head) pairs, row-major
    ok = r < pairs
    s, h = r // num_heads, r % num_heads
    src = KV + s * stride_kv_s + h * stride_kv_h
    n = tl.arange(0, NOPE_P2)
    mask = ok[:, None] & (n < NOPE)[None, :]
    tl.store(K + r[:, None] * WIDTH + n[None, :], tl.load(src[:, None] + n[None, :], mask=mask), mask=mask)
    p = tl.arange(0, ROPE_P2)
    mask = ok[:, None] & (p < ROPE)[None, :]
    pe = tl.load(KPe + s[:, None] * stride_pe + p[None, :], mask=mask)
    tl.store(K + r[:, None] * WIDTH + NOPE + p[None, :], pe, mask=mask)
    w = tl.arange(0, WIDTH_P2)
    v = tl.load(src[:, None] + NOPE + w[None, :], mask=ok[:, None] & (w < V_DIM)[None, :], other=0.0)
    tl.store(V + r[:, None] * V_WIDTH + w[None, :], v, mask=ok[:, None] & (w < V_WIDTH)[None, :])


def prefill_kv(
    kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, pad_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv: [rows, heads, nope_dim + v_dim] (kv_b_proj's output, last dimension contiguous); k_pe: [rows, rope]. Returns
    (K [rows, heads, nope_dim + rope], V [rows, heads, nope_dim + rope]: the values, zero past v_dim), contiguous;
    with pad_values False, V is [rows, heads, v_dim]. Padding needs v_dim <= nope_dim + rope (DeepSeek's 128 <= 192)."""
    rows, heads, _ = kv.shape
    rope, v_dim = k_pe.shape[-1], kv.shape[-1] - nope_dim
    width = nope_dim + rope
    v_width = width if pad_values else v_dim
    if v_dim > v_width or kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError(
            f"prefill_kv takes v_dim <= nope + rope ({v_dim} > {width}) and unit-stride last dims"
        )
    k = torch.empty(rows, heads, width, dtype=kv.dtype, device=kv.device)
    v = torch.empty(rows, heads, v_width, dtype=kv.dtype, device=kv.device)
    pairs = rows * heads
    block = 32
    if pairs:
        _prefill_kv_kernel[(triton.cdiv(pairs, block),)](
            kv, k_pe, k, v, pairs, heads, kv.stride(0), kv.stride(1), k_pe.stride(0),
            NOPE=nope_dim, ROPE=rope, V_DIM=v_dim, WIDTH=width, V_WIDTH=v_width,
            NOPE_P2=triton.next_power_of_2(nope_dim), ROPE_P2=triton.next_power_of_2(max(rope, 1)),
            WIDTH_P2=triton.next_power_of_2(max(width, v_width)), BLOCK=block,
            num_warps=4, **pdl_launch(kv),
        )  # fmt: skip
    return k, v


def prefill_kv_reference(
    kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, pad_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """prefill_kv in torch: the concatenation and the padding."""
    k_nope, v = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
    k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, kv.shape[1], -1)), dim=-1)
    if not pad_values:
        return k, v.contiguous()
    return k, torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
