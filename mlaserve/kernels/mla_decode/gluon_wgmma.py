"""The split step of paged MLA decode for many heads on Hopper (sm_90), written in Gluon.

Same work and outputs as `triton_split._stage1` at 64 heads per program: one sequence, one group of 64 query heads and
one slice of its context per program, partial outputs and base-2 LSEs for `partials._stage2` to merge. It exists because
Triton picks the warp layout of a dot by itself: a dot whose result feeds another dot (the scores feed the values' dot)
gets all warps along M, so with 64 heads and 8 warps both warpgroups computed the same 64 x 64 scores, twice the wgmma
the work needs. Gluon states layouts explicitly: here each warpgroup computes half of the tile's score columns, the
probabilities meet in shared memory, and each warpgroup accumulates half of the 512 output columns.

The tile loop double-buffers the KV tile with asynchronous copies: tile i + 1 is copied while tile i is worked on.
Leaving tile i's value dot running into step i + 1 was slower: the copy of tile i + 1 then has to wait for it. Gluon
kernels do not run under TRITON_INTERPRET; the Triton kernel stays the reference on CPU and on other GPUs, and tests/gpu
compares the two.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlaserve.kernels.mla_decode.gluon_common import (
    barrier,
    copy_tile,
    load_queries,
    split_range,
    store_empty_lse,
)
from mlaserve.kernels.mla_decode.partials import merge, split_step
from mlaserve.kernels.mla_decode.rules import DecodePlan


@gluon.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target"])
def stage1_wgmma(
    Q, QPe, KV, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    # Launched with 8 warps (two warpgroups), BLOCK_H = 64 (one wgmma M) and BLOCK_N = 64 rows, any PAGE.
    # Scores: warpgroup g computes columns [g * BLOCK_N / 2, (g + 1) * BLOCK_N / 2) for all BLOCK_H heads.
    scores: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    # Output: warpgroup g accumulates columns [g * D_LAT / 2, (g + 1) * D_LAT / 2).
    outs: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_LAT // 2, 16]
    )
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte copies, 128-byte row runs
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    b = gl.program_id(0)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    start, end = split_range(SeqLens, b, split, num_splits, split_target, BLOCK_N, gl.SliceLayout(1, rows))
    if start >= end:  # past this sequence's share of splits: an empty LSE, which the merge skips
        store_empty_lse(
            MidLse, b, head0, split, num_heads, stride_mlb, stride_mlh, BLOCK_H, gl.SliceLayout(1, rows)
        )
        return
    q, q_pe = load_queries(Q, QPe, b, head0, num_heads, stride_qb, stride_qh, stride_pb, stride_ph,
                            BLOCK_H, D_LAT, D_ROPE, rows)  # fmt: skip
    q_s = gl.allocate_shared_memory(q.dtype, [BLOCK_H, D_LAT], smem, q)
    qpe_s = gl.allocate_shared_memory(q.dtype, [BLOCK_H, D_ROPE], smem, q_pe)
    k_s = gl.allocate_shared_memory(KV.dtype.element_ty, [2, BLOCK_N, D_LAT], smem)
    pe_s = gl.allocate_shared_memory(KV.dtype.element_ty, [2, BLOCK_N, D_ROPE], smem)
    p_s = gl.allocate_shared_memory(q.dtype, [BLOCK_H, BLOCK_N], smem)

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, scores))
    # Row sums per column, reduced once at the end: a per-tile sum would cross warpgroups (through shared memory)
    # every step, which was slower.
    l_cols = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, scores)
    acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, outs)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, scores))

    copy_tile(k_s.index(0), pe_s.index(0), KV, BlockTable, b, start, end, stride_kv, stride_bt,
               PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
    tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(tiles):
        n0 = start + i * BLOCK_N
        buf = i % 2
        async_copy.wait_group(0)  # this thread's copies of tile i have landed
        fence_async_shared()  # ... and are visible to the tensor cores' reads
        # ... for every thread's copies. Both warpgroups are also past tile i - 1's value dot, so its buffer and p_s
        # are free: tile i + 1 is copied there now, a whole step ahead of its use. (One barrier per step was faster
        # than a second one after the value dot.)
        barrier()
        copy_tile(k_s.index(1 - buf), pe_s.index(1 - buf), KV, BlockTable, b, n0 + BLOCK_N, end, stride_kv,
                   stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
        k = k_s.index(buf)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, scores)
        s = warpgroup_mma(q_s, k.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qpe_s, pe_s.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])

        s = gl.where((n0 + cols < end)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_cols = l_cols * alpha[:, None] + p
        m = m_new
        p_s.store(p.to(q.dtype))
        fence_async_shared()
        barrier()  # both warpgroups' columns of p are in place
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, outs))[:, None]
        acc = warpgroup_mma(p_s, k, acc, is_async=True)  # the values are the latent part of the same rows
        acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(
        0
    )  # the last prefetch (past the end, all masked) must land before the program exits
    l_sum = gl.sum(l_cols, 1)

    has = l_sum > 0
    lse2 = gl.where(has, m + gl.log2(gl.where(has, l_sum, 1.0)), float("-inf"))  # -inf for an empty split
    inv = gl.convert_layout(1.0 / gl.where(has, l_sum, 1.0), gl.SliceLayout(1, outs))
    out = acc * inv[:, None]
    o_heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, outs))
    o_cols = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, outs))
    mo = MidO + b * stride_mob + o_heads[:, None] * stride_moh + split * stride_mos + o_cols[None, :]
    gl.store(mo, out.to(MidO.dtype.element_ty), mask=(o_heads < num_heads)[:, None])
    l_heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, scores))
    gl.store(MidLse + b * stride_mlb + l_heads * stride_mlh + split, lse2, mask=l_heads < num_heads)


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
    """The table entry's launch: the split step at the plan's tile (64 heads, 64 rows, 8 warps), then the merge."""
    step = split_step(plan, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    stage1_wgmma[step.grid](
        *step.args(q, q_pe), PAGE=kv_cache.shape[1], D_LAT=kv_lora_rank, D_ROPE=q_pe.shape[-1],
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, num_warps=plan.num_warps,
    )  # fmt: skip
    return merge(plan, step, q, seq_lens, kv_lora_rank)
