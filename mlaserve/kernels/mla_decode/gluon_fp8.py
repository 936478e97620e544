"""The split step of paged MLA decode over an fp8 latent cache at 16 heads per program on Hopper, in Gluon, with both
dots on fp8 tensor cores: the cache tile is never widened.

Same work as `triton_split._stage1` with an fp8 cache and BLOCK_H = 16, for one (sequence, head group, split) per CTA:
- Scores, Sᵀ = K·Qᵀ: the tile in shared memory is wgmma's A operand as copied (K-major fp8), so the 64 cached rows
  are M. The query goes in as two e4m3 terms per head (fp8_query.split_queries, about bf16's precision), stacked
  as N = 32 columns: hi terms, then lo terms.
- Values, Oᵀ = Vᵀ·Pᵀ: the 512 latent columns are M, in four chunks of 128, read from the tile 4 bytes at a time and
  regrouped in registers into wgmma's register operand (`_value_operand`). p goes in as two e4m3 terms as well.
- The cache's row scales enter p through the exponent: m is the running maximum of logit + log2(scale), so the
  scaled p stays within 2^8 and needs no separate rescaling.
What is left of the error is the fp8 tensor cores' own accumulation, within what the cache's own fp8 rounding
moves the reference by (tests/gpu/test_mla_decode_on_gpu.py bounds it). The widening kernel (gluon_wgmma8.py) takes
the fp8 calls where this one does not pay.

Three partitions (`gl.warp_specialize`): a producer warpgroup copies the split's tiles into a ring of SLOTS, and two
consumer warpgroups share the queries and take the tiles in turn. An fp8 tile is half a bf16 one and the dots cost the
same per row, so one warpgroup per CTA could not keep enough bytes in flight while it computed; here, while one consumer
works on a tile, the other's and the next copies are in flight. Each slot has a `ready` barrier (the copy landed) and an
`empty` one (its consumer is done with it), so the producer refills a slot exactly once it is free; how it copies a
tile, and reads the rows' scales with it, is gluon_fp8_ring.py's. Both consumers are workers: run in the default
partition, a consumer went through its tiles measurably slower than the worker beside it. At the end consumer 1 hands
its running state to consumer 0 through shared memory (`state_ready`), which combines the two and writes the CTA's one
partial, which halves the partials' stores and the merge's reads against each consumer writing its own. Consumer 0
copies the query terms into shared memory and signals consumer 1 (`q_ready`), so the producer's first copies are in
flight while the queries come. With PDL the kernel is launched programmatically dependent on the query split, whose
programs let it start at once: its CTAs are placed and start copying tiles while the split runs, and the consumers wait
for it (griddepcontrol.wait) only before reading the terms. It lets the merge launch early the same way
(partials._stage2 waits for it).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlaserve.kernels.mla_decode.fp8_query import split_queries
from mlaserve.kernels.mla_decode.gluon_common import (
    CHUNK,
    async_load,
    barrier,
    empty_state,
    normalizers,
    split_range,
    store_empty_lse,
    store_lse,
    view_as,
)
from mlaserve.kernels.mla_decode.gluon_fp8_ring import (
    LAT_CHUNKS,
    SLOTS,
    TAIL,
    TAIL_SMEM,
    producer,
    tma_descriptors,
)
from mlaserve.kernels.mla_decode.partials import merge, split_step
from mlaserve.kernels.mla_decode.rules import DecodePlan

# A chunk of the value tile as read from shared memory: [rows, 128 latent columns], each thread's registers holding
# 4 adjacent columns (one 32-bit load) of 16 rows. `_value_operand` relabels the columns so this is exactly the
# threads and registers of wgmma's fp8 register operand for Vᵀ; `_in_column_order` undoes it on the output.
V_CHUNK = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [16, 0], [32, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]],
        block_bases=[],
        shape=[64, 128],
    )
)
P_BITS = gl.constexpr(8.0)  # p goes in as p * 2^8 <= 256: e4m3 keeps 3 mantissa bits from 2^-6 up to 448


@gluon.jit
def _round_e4m3(x):
    """fp8_query.round_e4m3 in Gluon: x (|x| <= 448) rounded to an e4m3 value in fp32 arithmetic, so the residual
    is taken without converting back (residuals against e4m3 -> fp32 conversions came out wrong here, Triton 3.6)."""
    # the biased exponent bits, at least 2^-6's
    lead = gl.maximum(x.to(gl.int32, bitcast=True) & 0x7F800000, 121 << 23)
    step = (lead - (3 << 23)).to(gl.float32, bitcast=True)
    inv_step = ((254 << 23) - lead + (3 << 23)).to(gl.float32, bitcast=True)  # powers of two: exact products
    return gl.floor(x * inv_step + 0.5) * step


@gluon.jit
def _wait_for_prior_grid():
    """griddepcontrol.wait: with programmatic dependent launch, block until the grid this one was launched behind
    has finished and its stores are visible (at once without it)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _launch_dependents():
    """griddepcontrol.launch_dependents: a grid launched behind this one with programmatic dependent launch may start
    once every CTA here has made this call (or exited)."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _load_queries8(Terms, b, head0, num_heads, q_s, qpe_s, D_LAT: gl.constexpr, D_ROPE: gl.constexpr):
    """Copy heads head0 .. head0 + 16's query terms (fp8_query.split_queries) into q_s / qpe_s, hi rows then lo rows
    (zero past num_heads), and wait for them. Called by one warpgroup."""
    rows: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16-byte copies
    BLOCK_H: gl.constexpr = q_s.shape[0] // 2
    j = gl.arange(0, 2 * BLOCK_H, layout=gl.SliceLayout(1, rows))
    head = head0 + j % BLOCK_H
    row = ((b * num_heads + head) * 2 + j // BLOCK_H).to(gl.int64) * (D_LAT + D_ROPE)
    ok = (head < num_heads)[:, None]
    async_load(
        q_s, Terms + row[:, None] + gl.arange(0, D_LAT, layout=gl.SliceLayout(0, rows))[None, :], mask=ok
    )
    rope = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rows))
    async_load(qpe_s, Terms + row[:, None] + D_LAT + rope[None, :], mask=ok)
    async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _slot_scales(tails, layout: gl.constexpr):
    """The row scales of a tile from its tails in shared memory ([rows, 16] bytes, each row's float32 scale first), as
    one float per row in `layout`, the scores' row slice: each thread reads the scales of its own two rows."""
    BLOCK_N: gl.constexpr = tails.shape[0]
    f32: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    words = view_as(tails, gl.float32, [BLOCK_N, TAIL // 4], f32)
    # The rows of the scores' layout (16 per warp, lane // 4 and 8 more per thread), the four lanes of a row alike.
    rows: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[BLOCK_N, 1],
    )
    scale = words.slice(0, 1, dim=1).load(rows)
    return gl.convert_layout(gl.sum(scale, 1), layout)  # the same registers: no data moves


@gluon.jit
def _value_operand(v8, a_layout: gl.constexpr):
    """Vᵀ for the values' dot from a [64 rows, 128 columns] fp8 chunk in shared memory, read 4 columns at a time.
    Operand row m holds a latent column whose bits are m's, reordered (below): the order makes each thread's 4
    operand rows adjacent columns, so the bytes are regrouped inside each thread (no byte-wise shared-memory reads)."""
    x = v8.load(V_CHUNK)
    # column c = b6..b0 (bits); operand row m = (b1, b6, b5, b0, b4, b3, b2), most significant first
    x = gl.permute(gl.reshape(x, [64, 2, 2, 2, 2, 2, 2, 2]), (0, 6, 1, 2, 7, 3, 4, 5))
    return gl.convert_layout(gl.permute(gl.reshape(x, [64, 128]), (1, 0)), a_layout)


@gluon.jit
def _in_column_order(acc):
    """acc [CHUNK, heads] from the values' dot, whose rows are latent columns in _value_operand's order, relabelled
    so that row c holds column c: the same registers, under the inverse bit permutation (m = (c1, c6, c5, c0, c4, c3,
    c2) reads as c = (m5, m4, m2, m1, m0, m6, m3), most significant bit first)."""
    H: gl.constexpr = acc.shape[1]
    x = gl.reshape(acc, [2, 2, 2, 2, 2, 2, 2, H])
    return gl.reshape(gl.permute(x, (1, 2, 4, 5, 6, 0, 3, 7)), [CHUNK, H])


@gluon.jit
def _store_partial(stage, MidO, MidLse, acc0, acc1, acc2, acc3, m, l_sum, b, head0, split, num_heads,
                   stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, LSE_SHIFT: gl.constexpr):  # fmt: skip
    """Write the CTA's partial result: Oᵀ over the sums of p, through `stage` (shared memory, [heads, D_LAT] fp32)
    so that each head's row goes out in 16-byte stores, and the base-2 LSE m + log2(sum) - LSE_SHIFT (-inf for an
    empty split). Written straight from the accumulators' layout (gluon_wgmma8._store_partials), the stores
    would be 4 bytes each, scattered over the rows, and slower."""
    BLOCK_H: gl.constexpr = m.shape[0]
    D_LAT: gl.constexpr = stage.shape[1]
    outs: gl.constexpr = acc0.type.layout
    lse2, inv = normalizers(m, l_sum, outs, LSE_SHIFT)
    stage.slice(0 * CHUNK, CHUNK, dim=1).store(gl.permute(_in_column_order(acc0 * inv[None, :]), (1, 0)))
    stage.slice(1 * CHUNK, CHUNK, dim=1).store(gl.permute(_in_column_order(acc1 * inv[None, :]), (1, 0)))
    stage.slice(2 * CHUNK, CHUNK, dim=1).store(gl.permute(_in_column_order(acc2 * inv[None, :]), (1, 0)))
    stage.slice(3 * CHUNK, CHUNK, dim=1).store(gl.permute(_in_column_order(acc3 * inv[None, :]), (1, 0)))
    barrier()  # the warpgroup's writes, before its reads of other threads' values
    # each warp writes 512 bytes of one head's row at a time
    rows: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    o = stage.load(rows)
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    cols = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, rows))
    mo = MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + cols[None, :]
    gl.store(mo, o.to(MidO.dtype.element_ty), mask=(heads < num_heads)[:, None])
    store_lse(MidLse, lse2, b, head0, split, num_heads, stride_mlb, stride_mlh)


@gluon.jit
def _values(v8, p_hi, p_lo, acc, alpha, a_layout: gl.constexpr):
    """acc * alpha + Vᵀ · (p_hi + p_lo)ᵀ for one chunk: the value operand is read once and used for both terms."""
    a = _value_operand(v8, a_layout)
    acc = warpgroup_mma(a, p_hi.permute((1, 0)), acc * alpha[None, :], is_async=True)
    return warpgroup_mma(a, p_lo.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _scores(
    k_ring, pe_ring, ready, q_s, qpe_s, t, start, end, tiles, both: gl.constexpr, BLOCK_N: gl.constexpr
):
    """Wait for tile t of the split and issue its score dots against both query terms, Sᵀ = K·Qᵀ (asynchronous: the
    caller waits). Past the split's last tile the slot is stale and is not waited for; its scores go unused."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    TERMS: gl.constexpr = q_s.shape[0]  # hi then lo terms of each head
    slot = t % SLOTS
    mbarrier.wait(ready.index(slot), (t // SLOTS) & 1, pred=t < tiles)
    if start + (t + 1) * BLOCK_N > end:
        fence_async_shared()  # the last tile came by cp.async: its stores, before the tensor cores read them
    s2 = gl.zeros([BLOCK_N, TERMS], gl.float32, both)
    s2 = warpgroup_mma(k_ring.index(slot), q_s.permute((1, 0)), s2, is_async=True)
    return warpgroup_mma(pe_ring.index(slot), qpe_s.permute((1, 0)), s2, is_async=True)


@gluon.jit
def _consumer(
    c: gl.constexpr,
    Terms, Scales, q_ready, start, end, MidO, MidLse,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2,
    k_ring, pe_ring, tail_ring, ready, empty, q_s, qpe_s, p_his, p_los, m_l, state_ready,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    PDL: gl.constexpr,
):  # fmt: skip
    """Consumer c of 2: tiles c, c + 2, ... of the split, from ring slots of its own parity (the ring's size is even,
    so each slot has one consumer); it releases each tile's slot to the producer once both dots are done with it. A
    tile's score dots are issued right behind the previous tile's value dots, so the two run together on the tensor
    cores and one wait covers both."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    # Scores against both query terms: columns [0, BLOCK_H) are hi, [BLOCK_H, 2 * BLOCK_H) lo.
    both: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_H, 32]
    )
    scores: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 32]
    )
    outs: gl.constexpr = scores
    a_values: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=outs, k_width=4)
    b = gl.program_id(0)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    tiles = gl.cdiv(end - start, BLOCK_N)
    if PDL:  # the query terms and scales are the output of the grid this one was launched behind
        _wait_for_prior_grid()
    if c == 0:
        _load_queries8(Terms, b, head0, num_heads, q_s, qpe_s, D_LAT, D_ROPE)
        fence_async_shared()  # the queries, before the tensor cores read them
        barrier()
        mbarrier.arrive(q_ready)
    else:
        mbarrier.wait(q_ready, 0)
        fence_async_shared()
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, scores))
    q_scales = Scales + (b * num_heads + heads) * 2
    q_hi_scale = gl.load(q_scales, mask=heads < num_heads, other=1.0)
    q_lo_scale = gl.load(q_scales + 1, mask=heads < num_heads, other=1.0)
    p_hi = p_his.index(c)  # p in two e4m3 terms, as [heads, rows] (K-major B operands)
    p_lo = p_los.index(c)
    n_idx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scores))

    acc0, acc1, acc2, acc3, m, l_rows = empty_state(outs, scores, BLOCK_N)
    s2 = _scores(k_ring, pe_ring, ready, q_s, qpe_s, c, start, end, tiles, both, BLOCK_N)
    s2 = warpgroup_mma_wait(0, deps=[s2])
    for k in range(gl.cdiv(tiles - c, 2)):
        t = c + 2 * k
        n0 = start + t * BLOCK_N
        slot = t % SLOTS
        # the row scales came with the tile (the scores' wait covered them)
        scale_i = _slot_scales(tail_ring.index(slot), gl.SliceLayout(1, scores))
        k8 = k_ring.index(slot)
        s_hi, s_lo = gl.split(gl.permute(gl.reshape(s2, [BLOCK_N, 2, BLOCK_H]), (0, 2, 1)))
        s = (
            gl.convert_layout(s_hi, scores) * q_hi_scale[None, :]
            + gl.convert_layout(s_lo, scores) * q_lo_scale[None, :]
        )

        # Base-2 logits, and the same plus log2 of the row's scale: the values' row scales enter p through the
        # exponent, and m is the running maximum of the latter, so p * scale <= 2^P_BITS always.
        s = gl.where((n0 + n_idx < end)[:, None], s * (scale_i * scale_log2)[:, None], float("-inf"))
        t_s = s + gl.log2(scale_i)[:, None]
        m_new = gl.maximum(m, gl.max(t_s, 0))
        alpha = gl.exp2(m - m_new)
        l_rows = l_rows * alpha[None, :] + gl.exp2(s - m_new[None, :] + P_BITS)
        m = m_new
        p = gl.exp2(t_s - m_new[None, :] + P_BITS)
        p_top = _round_e4m3(p)
        p_hi.store(gl.permute(p_top.to(gl.float8e4nv), (1, 0)))
        p_lo.store(gl.permute((p - p_top).to(gl.float8e4nv), (1, 0)))
        fence_async_shared()
        barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, outs))
        acc0 = _values(k8.slice(0 * CHUNK, CHUNK, dim=1), p_hi, p_lo, acc0, alpha_o, a_values)
        acc1 = _values(k8.slice(1 * CHUNK, CHUNK, dim=1), p_hi, p_lo, acc1, alpha_o, a_values)
        acc2 = _values(k8.slice(2 * CHUNK, CHUNK, dim=1), p_hi, p_lo, acc2, alpha_o, a_values)
        acc3 = _values(k8.slice(3 * CHUNK, CHUNK, dim=1), p_hi, p_lo, acc3, alpha_o, a_values)
        s2 = _scores(k_ring, pe_ring, ready, q_s, qpe_s, t + 2, start, end, tiles, both, BLOCK_N)
        acc0, acc1, acc2, acc3, s2 = warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3, s2])
        barrier()  # every warp of this warpgroup is done with the slot (and p)
        fence_async_shared()  # ... and its reads of the slot are ordered before the copy's writes
        mbarrier.arrive(empty.index(slot))  # the producer may refill it

    # This consumer's ring slots are free once its last tile is done. Consumer 1 hands its state to consumer 0
    # through one of them, and consumer 0 writes the CTA's one partial through another.
    l_sum = gl.sum(l_rows, 0)
    f32: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    state = view_as(k_ring.index(1), gl.float32, [4 * CHUNK, BLOCK_H], f32)
    stage = view_as(k_ring.index(0), gl.float32, [BLOCK_H, D_LAT], f32)
    if c == 1:
        state.slice(0 * CHUNK, CHUNK, dim=0).store(acc0)
        state.slice(1 * CHUNK, CHUNK, dim=0).store(acc1)
        state.slice(2 * CHUNK, CHUNK, dim=0).store(acc2)
        state.slice(3 * CHUNK, CHUNK, dim=0).store(acc3)
        m_l.slice(0, BLOCK_H).store(m)
        m_l.slice(BLOCK_H, BLOCK_H).store(l_sum)
        barrier()  # every thread's part, before the one arrival
        mbarrier.arrive(state_ready)
    else:
        mbarrier.wait(state_ready, 0)
        m1 = m_l.slice(0, BLOCK_H).load(gl.SliceLayout(0, scores))
        l1 = m_l.slice(BLOCK_H, BLOCK_H).load(gl.SliceLayout(0, scores))
        m_both = gl.maximum(m, m1)
        m_base = gl.where(m_both == float("-inf"), 0.0, m_both)  # both empty: keep exp2 finite (0)
        w0 = gl.exp2(m - m_base)
        w1 = gl.exp2(m1 - m_base)
        l_sum = l_sum * w0 + l1 * w1
        w0 = gl.convert_layout(w0, gl.SliceLayout(0, outs))[None, :]
        w1 = gl.convert_layout(w1, gl.SliceLayout(0, outs))[None, :]
        acc0 = acc0 * w0 + state.slice(0 * CHUNK, CHUNK, dim=0).load(outs) * w1
        acc1 = acc1 * w0 + state.slice(1 * CHUNK, CHUNK, dim=0).load(outs) * w1
        acc2 = acc2 * w0 + state.slice(2 * CHUNK, CHUNK, dim=0).load(outs) * w1
        acc3 = acc3 * w0 + state.slice(3 * CHUNK, CHUNK, dim=0).load(outs) * w1
        _store_partial(stage, MidO, MidLse, acc0, acc1, acc2, acc3, m_both, l_sum, b, head0, split, num_heads,
                       stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, P_BITS)  # fmt: skip


@gluon.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target"])
def stage1_fp8(
    Terms, Scales, KV, DescLat, DescPe, DescTail, BlockTable, SeqLens, MidO, MidLse,
    stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    PDL: gl.constexpr,
):  # fmt: skip
    # Launched with 4 warps (the producer; the consumers are 4-warp workers), BLOCK_H = 16 heads, BLOCK_N = 64
    # rows, D_LAT = 4 * CHUNK, PAGE % 64 == 0. DescLat / DescPe / DescTail: TMA descriptors over the cache's rows
    # with boxes of [LAT_CHUNKS, 64, CHUNK], [64, D_ROPE] and [64, TAIL] (tma_descriptors). Partial output `split`
    # is this CTA's.
    if PDL:  # the merge may be placed beside this grid's last CTAs, where it waits for them
        _launch_dependents()
    gl.static_assert(D_LAT == LAT_CHUNKS * CHUNK)
    gl.static_assert(BLOCK_N == 64)
    # The split's rows, for all three partitions. A CTA past its sequence's share of splits (the grid's spare room,
    # rules.grid_splits) ends here, before they start: it holds its SM for the lengths' sum and one store,
    # not for a query load and a dot.
    heads_1d: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    start, end = split_range(
        SeqLens, gl.program_id(0), gl.program_id(2), num_splits, split_target, BLOCK_N, heads_1d
    )
    if start >= end:
        if PDL:  # no store before the grid launched ahead of this one is done (the graph pool reuses memory)
            _wait_for_prior_grid()
        store_empty_lse(MidLse, gl.program_id(0), gl.program_id(1) * BLOCK_H, gl.program_id(2), num_heads,
                         stride_mlb, stride_mlh, BLOCK_H, heads_1d)  # fmt: skip
        return
    lat_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    pe_smem: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=min(D_ROPE, 128), element_bitwidth=8, rank=2
    )
    p_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=8, rank=2)

    k_ring = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BLOCK_N, D_LAT], lat_smem)
    pe_ring = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BLOCK_N, D_ROPE], pe_smem)
    tail_ring = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BLOCK_N, TAIL], TAIL_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    q_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, D_LAT], lat_smem)
    qpe_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, D_ROPE], pe_smem)
    p_his = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_H, BLOCK_N], p_smem)
    p_los = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_H, BLOCK_N], p_smem)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    state_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    m_l = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(q_ready, count=1)
    mbarrier.init(state_ready, count=1)
    fence_async_shared()  # the initialized barriers, before the copies' arrivals
    barrier()
    gl.warp_specialize(
        [
            (producer, (KV, DescLat, DescPe, DescTail, BlockTable, start, end, stride_kv, stride_bt, k_ring,
                         pe_ring, tail_ring, ready, empty, PAGE, D_LAT, D_ROPE, BLOCK_N)),
            (_consumer, (0, Terms, Scales, q_ready, start, end, MidO, MidLse, stride_mob, stride_moh, stride_mos,
                         stride_mlb, stride_mlh, num_heads, scale_log2, k_ring, pe_ring, tail_ring,
                         ready, empty, q_s, qpe_s, p_his, p_los, m_l, state_ready, PAGE, D_LAT, D_ROPE, BLOCK_H,
                         BLOCK_N, PDL)),
            (_consumer, (1, Terms, Scales, q_ready, start, end, MidO, MidLse, stride_mob, stride_moh, stride_mos,
                         stride_mlb, stride_mlh, num_heads, scale_log2, k_ring, pe_ring, tail_ring,
                         ready, empty, q_s, qpe_s, p_his, p_los, m_l, state_ready, PAGE, D_LAT, D_ROPE, BLOCK_H,
                         BLOCK_N, PDL)),
        ],
        [4, 4],
        [232, 232],
    )  # fmt: skip


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
    """The table entry's launch: the query split into e4m3 terms, the split step (16 heads, 64 rows, the producer's
    4 warps) behind it, then the merge; each launched on programmatic dependent launch where plan.pdl."""
    step = split_step(plan, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    d_rope = q_pe.shape[-1]
    stage1_fp8[step.grid](
        *split_queries(q, q_pe, launch_dependents=plan.pdl), step.kv, *tma_descriptors(step.kv, d_rope),
        *step.tensors[1:], *step.strides, *step.sizes, PAGE=kv_cache.shape[1], D_LAT=kv_lora_rank, D_ROPE=d_rope,
        BLOCK_H=16, BLOCK_N=64, PDL=plan.pdl, num_warps=4, **({"launch_pdl": True} if plan.pdl else {}),
    )  # fmt: skip
    return merge(plan, step, q, seq_lens, kv_lora_rank)
