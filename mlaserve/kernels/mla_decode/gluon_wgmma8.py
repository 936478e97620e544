"""The split step of paged MLA decode over an 8-bit latent cache at 16 heads per program on Hopper, in Gluon.

Same work and outputs as `triton_split._stage1` with a quantized cache and BLOCK_H = 16. With 16 heads the scores are
computed transposed, Sᵀ = K·Qᵀ, so the 64 cached rows of a tile are wgmma's M and the heads its N; the values' dot
likewise runs as Oᵀ = Vᵀ·Pᵀ with the 512 latent columns as M, in four chunks of 128. Both dots take the cache tile
as their register operand: 8-bit rows are copied to shared memory as they are, read straight into wgmma's operand
layout and widened to fp16 there, so the widened tile never goes back through shared memory. Row scales are applied
to the scores and folded into p, as in the Triton kernel. fp8 caches take gluon_fp8.py by default, which
converts nothing, where rules.fp8_dots_pay says it is faster; this kernel runs the other fp8 calls, and int8
caches where a benchmark names it (dispatch.py: for int8 it does not pay).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mlaserve.kernels.mla_decode.gluon_common import (
    CHUNK,
    barrier,
    copy_tile,
    empty_state,
    load_queries,
    normalizers,
    split_range,
    store_empty_lse,
    store_lse,
)
from mlaserve.kernels.mla_decode.partials import merge, split_step
from mlaserve.kernels.mla_decode.rules import DecodePlan
from mlaserve.kernels.mla_decode.widen import widen_bits


@gluon.jit
def _copy_tile8(
    k_dst, pe_dst, KV, BlockTable, b, n0, end, stride_kv, stride_bt,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr, rows: gl.constexpr,
):  # fmt: skip
    """Start copying the 8-bit values of rows n0 .. n0 + BLOCK_N (zero past `end`); return the rows' scales."""
    base, ok = copy_tile(k_dst, pe_dst, KV, BlockTable, b, n0, end, stride_kv, stride_bt,
                          PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
    return gl.load((base + D_LAT + D_ROPE).to(gl.pointer_type(gl.float32)), mask=ok, other=0.0)


@gluon.jit
def _widen(x):
    """8-bit operand -> fp16. fp8 takes the paired conversion instruction (integer operations were slower here),
    int8 integer operations packed two to a register."""
    if x.dtype == gl.int8:
        y = widen_bits(x, gl.float16)
    else:
        y = x.to(gl.float16)
    return y


@gluon.jit
def _scores_part(k8, q_part, s, a_layout: gl.constexpr):
    """s += (8-bit rows of k8, widened) · q_partᵀ."""
    a = _widen(k8.load(a_layout))
    return warpgroup_mma(a, q_part.permute((1, 0)), s)


@gluon.jit
def _values_chunk(v8, p_s, acc, alpha, a_layout: gl.constexpr):
    """acc * alpha + (8-bit value columns of v8, widened)ᵀ · pᵀ, for one chunk of latent columns."""
    a = _widen(v8.permute((1, 0)).load(a_layout))
    return warpgroup_mma(a, p_s, acc * alpha[None, :])


@gluon.jit
def _store_partials(
    MidO, MidLse, acc0, acc1, acc2, acc3, m, l_rows, b, head0, split, num_heads,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
):  # fmt: skip
    """Write a split's result: Oᵀ in four chunks of CHUNK latent columns (heads as N) over p's row sums, straight
    from the accumulators' layout, and its LSE."""
    BLOCK_H: gl.constexpr = m.shape[0]
    outs: gl.constexpr = acc0.type.layout
    lse2, inv = normalizers(m, gl.sum(l_rows, 0), outs, 0.0)
    o_heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, outs))
    o_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, outs))
    mo = MidO + b * stride_mob + o_heads[None, :] * stride_moh + split * stride_mos + o_cols[:, None]
    o_ok = (o_heads < num_heads)[None, :]
    gl.store(mo + 0 * CHUNK, (acc0 * inv[None, :]).to(MidO.dtype.element_ty), mask=o_ok)
    gl.store(mo + 1 * CHUNK, (acc1 * inv[None, :]).to(MidO.dtype.element_ty), mask=o_ok)
    gl.store(mo + 2 * CHUNK, (acc2 * inv[None, :]).to(MidO.dtype.element_ty), mask=o_ok)
    gl.store(mo + 3 * CHUNK, (acc3 * inv[None, :]).to(MidO.dtype.element_ty), mask=o_ok)
    store_lse(MidLse, lse2, b, head0, split, num_heads, stride_mlb, stride_mlh)


@gluon.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target"])
def stage1_wgmma8(
    Q, QPe, KV, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    # Launched with 4 warps (one warpgroup), BLOCK_H = 16 heads, BLOCK_N = 64 rows, D_LAT = 4 * CHUNK, PAGE % 64 == 0.
    gl.static_assert(D_LAT == 4 * CHUNK)
    scores: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    a_scores: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=scores, k_width=2)
    rows: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16-byte copies
    smem8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    smem16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)

    b = gl.program_id(0)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    start, end = split_range(SeqLens, b, split, num_splits, split_target, BLOCK_N, gl.SliceLayout(1, rows))
    if start >= end:  # past this sequence's share of splits: an empty LSE, which the merge skips
        store_empty_lse(
            MidLse, b, head0, split, num_heads, stride_mlb, stride_mlh, BLOCK_H, gl.SliceLayout(1, rows)
        )
        return
    q_rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q, q_pe = load_queries(Q, QPe, b, head0, num_heads, stride_qb, stride_qh, stride_pb, stride_ph,
                            BLOCK_H, D_LAT, D_ROPE, q_rows)  # fmt: skip
    q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, D_LAT], smem16, q.to(gl.float16))
    qpe_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, D_ROPE], smem16, q_pe.to(gl.float16))
    k_s = gl.allocate_shared_memory(KV.dtype.element_ty, [2, BLOCK_N, D_LAT], smem8)
    pe_s = gl.allocate_shared_memory(KV.dtype.element_ty, [2, BLOCK_N, D_ROPE], smem8)
    p_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_H], p_smem)

    # Values: Oᵀ in four chunks of CHUNK latent columns (M), the heads as N.
    outs: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    a_values: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=outs, k_width=2)
    acc0, acc1, acc2, acc3, m, l_rows = empty_state(outs, scores, BLOCK_N)
    n_idx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scores))

    row_scale = _copy_tile8(k_s.index(0), pe_s.index(0), KV, BlockTable, b, start, end, stride_kv, stride_bt,
                            PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
    tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(tiles):
        n0 = start + i * BLOCK_N
        buf = i % 2
        async_copy.wait_group(0)
        barrier()  # every thread's copies of tile i have landed; tile i - 1's buffer and p_s are free
        scale_i = gl.convert_layout(row_scale, gl.SliceLayout(1, scores))
        row_scale = _copy_tile8(k_s.index(1 - buf), pe_s.index(1 - buf), KV, BlockTable, b, n0 + BLOCK_N, end,
                                stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
        k8 = k_s.index(buf)
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, scores)
        for c in gl.static_range(D_LAT // CHUNK):
            s = _scores_part(
                k8.slice(c * CHUNK, CHUNK, dim=1), q_s.slice(c * CHUNK, CHUNK, dim=1), s, a_scores
            )
        s = _scores_part(pe_s.index(buf), qpe_s, s, a_scores)

        s = gl.where((n0 + n_idx < end)[:, None], s * (scale_i * scale_log2)[:, None], float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_rows = l_rows * alpha[None, :] + p
        m = m_new
        p_s.store((p * scale_i[:, None]).to(gl.float16))  # the values' row scales, folded into p
        fence_async_shared()
        barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, outs))
        acc0 = _values_chunk(k8.slice(0 * CHUNK, CHUNK, dim=1), p_s, acc0, alpha_o, a_values)
        acc1 = _values_chunk(k8.slice(1 * CHUNK, CHUNK, dim=1), p_s, acc1, alpha_o, a_values)
        acc2 = _values_chunk(k8.slice(2 * CHUNK, CHUNK, dim=1), p_s, acc2, alpha_o, a_values)
        acc3 = _values_chunk(k8.slice(3 * CHUNK, CHUNK, dim=1), p_s, acc3, alpha_o, a_values)
    async_copy.wait_group(0)

    _store_partials(MidO, MidLse, acc0, acc1, acc2, acc3, m, l_rows, b, head0, split, num_heads,
                    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)  # fmt: skip


def launch(
    plan: DecodePlan,
    q: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table entry's launch: the split step (16 heads, 64 rows, 4 warps), then the merge."""
    step = split_step(plan, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    stage1_wgmma8[step.grid](
        *step.args(q, q_pe), PAGE=kv_cache.shape[1], D_LAT=kv_lora_rank, D_ROPE=q_pe.shape[-1], BLOCK_H=16,
        BLOCK_N=64, num_warps=4,
    )  # fmt: skip
    return merge(plan, step, q, seq_lens, kv_lora_rank)
