"""The split step of paged MLA decode for 64+ heads over a 16-bit cache on Hopper (sm_90), in Gluon, on FlashMLA's
"seesaw" schedule.

Same work and outputs as `gluon_wgmma.stage1_wgmma` (one sequence, 64 query heads and one slice of its context per
CTA; partial outputs and base-2 LSEs for `partials._stage2`), scheduled so the tensor cores are not idle during each
softmax. gluon_wgmma's step is serial: scores -> softmax -> p to shared memory -> values, with both warpgroups on one
tile. Here each warpgroup owns half of the output's 512 columns (a 64 x 256 float32 accumulator, all the registers
one warpgroup can spare) and the two take the tiles' scores in turn: consumer 0 computes the scores of tiles 0, 2,
4, ..., consumer 1 those of tiles 1, 3, 5, ...; both then multiply both tiles' p by their own half of the values.
While one consumer runs its softmax the other's dots keep the tensor cores busy. A pair of tiles (a, b) goes:

    consumer 0: Sa = Q·Kaᵀ; m_a = max(m, rowmax Sa); Pa -> smem, m_a -> smem      (signals `sent[0]`)
                O_L = O_L·2^(m - m_a) + Pa·Va_L; waits for `sent[1]`
                O_L = O_L·2^(m_a - m_b) + Pb·Vb_L; m = m_b
    consumer 1: Sb = Q·Kbᵀ; waits for `sent[0]`; O_R = O_R·2^(m - m_a) + Pa·Va_R (issued, not awaited)
                m_b = max(m_a, rowmax Sb); Pb -> smem, m_b -> smem                 (signals `sent[1]`)
                O_R = O_R·2^(m_a - m_b) + Pb·Vb_R; m = m_b

Each consumer keeps the row sums of its own tiles' p, relative to the same running max; the two sums are added at
the end. Consumer 1 issues Pa's value dot before its own softmax, so that dot runs under the softmax (FlashMLA
instead rescales Pa in registers after the softmax; this keeps every dot's operands in shared memory, the path
gluon_wgmma has run).

Shared memory: the queries (64 x 576 16-bit values, 72 KiB) and a ring of SLOTS tiles of rows, which a producer
warpgroup (the default partition, few registers; gluon_seesaw_ring.py) fills by cp.async, or whole tiles by TMA where
the plan asks (`tma`), counted on each slot's `ready` barrier; both consumers release a slot (`empty`, two arrivals)
once their value dots are done with it, tile a's before tile b's value dot so that its refill overlaps the dot. A
tile's p goes where its rope columns were: only the consumer that computed the tile's scores reads them, and it is
done with them when p is ready, and [64 heads, BLOCK_N] 16-bit values are exactly the [BLOCK_N, 64] rope block's
bytes. With 32-row tiles four slots fit beside the queries, so one pair is copied while the other is worked on;
FlashMLA's 64-row tiles leave room for two (block_n=64, a tuning choice: its score dots read the queries half as
often per row, but a pair's copy then waits for the previous pair's value dots).

Gluon kernels do not run under TRITON_INTERPRET; tests/gpu/test_mla_decode_seesaw.py checks this one on a GPU and
tests/kernels/test_gluon_compile.py compiles it for sm_90 on any machine.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlaserve.kernels.mla_decode.gluon_common import barrier, split_range, store_empty_lse, view_as
from mlaserve.kernels.mla_decode.gluon_seesaw_ring import producer, tma_descriptors
from mlaserve.kernels.mla_decode.partials import merge, split_step
from mlaserve.kernels.mla_decode.rules import DecodePlan, tma_rows

# Consumers' registers: a 64 x 256 float32 accumulator takes 128 per thread; the producer keeps what is left.
CONSUMER_REGS = gl.constexpr(232)


@gluon.jit
def _issue_scores(q_s, qpe_s, k_ring, pe_ring, ready, t, scores: gl.constexpr, exists=True):
    """Wait for tile t's copy (unless it does not `exist`) and issue its score dots against the queries, [heads,
    rows] in `scores` (asynchronous: the caller waits)."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    BLOCK_H: gl.constexpr = q_s.shape[0]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    slot = t % SLOTS
    mbarrier.wait(ready.index(slot), (t // SLOTS) & 1, pred=exists)
    fence_async_shared()  # a tile that came by cp.async: its stores, before the tensor cores read them
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, scores)
    s = warpgroup_mma(q_s, k_ring.index(slot).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qpe_s, pe_ring.index(slot).permute((1, 0)), s, is_async=True)


@gluon.jit
def _logits(s, n0, end, scale_log2):
    """Base-2 logits from the scores of the tile at row n0, -inf past the sequence's end."""
    cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    return gl.where((n0 + cols < end)[None, :], s * scale_log2, float("-inf"))


@gluon.jit
def _publish(p, m_new, p_dst, m_dst, sent):
    """Hand a tile's p (into its slot's rope block) and the running max after it to the other consumer."""
    p_dst.store(p.to(p_dst.dtype))
    m_dst.store(m_new)
    fence_async_shared()  # p, before either consumer's tensor cores read it
    barrier()  # every thread's part, before the one arrival
    mbarrier.arrive(sent)


@gluon.jit
def _receive(sent, j, ready, t):
    """Wait for the other consumer's p and max of pair j, whose tile t this one then reads as values: its slot's
    copy has landed (the other consumer waited for it; the phase is complete, so this wait is only the direct
    acquire of the copy's writes), and those writes are ordered before this consumer's tensor-core reads."""
    SLOTS: gl.constexpr = ready.shape[0]
    mbarrier.wait(sent, j & 1)
    mbarrier.wait(ready.index(t % SLOTS), (t // SLOTS) & 1)
    fence_async_shared()


@gluon.jit
def _release(empty):
    """This consumer is done with a slot (its value dot has been waited for): the producer may refill it once the
    other consumer is too. Tile a's slot goes back before tile b's value dot, so its refill overlaps that dot."""
    barrier()  # every warp of this consumer is done with the slot (and its p)
    fence_async_shared()  # ... and its reads of it are ordered before the next copy's writes
    mbarrier.arrive(empty)


@gluon.jit
def _consumer(
    c: gl.constexpr,
    start, end, b, head0, split, num_heads, scale_log2, MidO, MidLse,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    q_s, qpe_s, k_ring, pe_ring, q_ready, ready, empty, sent, maxes, sums, summed, PREFETCH: gl.constexpr,
):  # fmt: skip
    """Consumer c of 2 (the module's schedule): scores of tiles c, c + 2, ...; columns [c * D_LAT / 2, (c + 1) *
    D_LAT / 2) of every tile's values; writes its half of the partial output, and consumer 0 the LSE."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    HALF: gl.constexpr = k_ring.shape[2] // 2
    BLOCK_H: gl.constexpr = q_s.shape[0]
    scores: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    outs: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    p_smem: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=min(2 * BLOCK_N, 128), element_bitwidth=16, rank=2
    )
    heads_of_outs: gl.constexpr = gl.SliceLayout(1, outs)
    heads_of_scores: gl.constexpr = gl.SliceLayout(1, scores)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, heads_of_scores)
    l_sum = gl.zeros([BLOCK_H], gl.float32, heads_of_scores)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, outs)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()  # the queries came by cp.async

    pairs = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)
    # With PREFETCH consumer 0 issues each pair's first score dots behind the previous pair's last value dots (one
    # wait covers both), so at a pair's start its scores are ahead of consumer 1's and its softmax runs under their
    # dots. It costs registers: the scores are live beside the accumulator across pairs (ptxas spills some).
    if c == 0 and PREFETCH:
        s = _issue_scores(q_s, qpe_s, k_ring, pe_ring, ready, 0, scores)
        s = warpgroup_mma_wait(0, deps=[s])
    for j in range(pairs):
        slot_a = (2 * j) % SLOTS
        slot_b = (2 * j + 1) % SLOTS
        p_a = view_as(pe_ring.index(slot_a), q_s.dtype, [BLOCK_H, BLOCK_N], p_smem)
        p_b = view_as(pe_ring.index(slot_b), q_s.dtype, [BLOCK_H, BLOCK_N], p_smem)
        v_a = k_ring.index(slot_a).slice(c * HALF, HALF, dim=1)
        v_b = k_ring.index(slot_b).slice(c * HALF, HALF, dim=1)
        if c == 0:
            if not PREFETCH:
                s = warpgroup_mma_wait(
                    0, deps=[_issue_scores(q_s, qpe_s, k_ring, pe_ring, ready, 2 * j, scores)]
                )
            s = _logits(s, start + 2 * j * BLOCK_N, end, scale_log2)
            m_a = gl.maximum(m, gl.max(s, 1))
            p = gl.exp2(s - m_a[:, None])
            _publish(p, m_a, p_a, maxes.slice(0, BLOCK_H), sent.index(0))
            alpha = gl.exp2(m - m_a)
            l_sum = l_sum * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, heads_of_outs)[:, None]
            acc = warpgroup_mma(p_a, v_a, acc, is_async=True)
            _receive(sent.index(1), j, ready, 2 * j + 1)
            m_b = maxes.slice(BLOCK_H, BLOCK_H).load(heads_of_scores)
            beta = gl.exp2(m_a - m_b)
            l_sum = l_sum * beta
            acc = warpgroup_mma_wait(0, deps=[acc])
            _release(empty.index(slot_a))
            acc = acc * gl.convert_layout(beta, heads_of_outs)[:, None]
        else:
            n0 = start + (2 * j + 1) * BLOCK_N
            s = _issue_scores(q_s, qpe_s, k_ring, pe_ring, ready, 2 * j + 1, scores)
            s = _logits(warpgroup_mma_wait(0, deps=[s]), n0, end, scale_log2)
            _receive(sent.index(0), j, ready, 2 * j)
            m_a = maxes.slice(0, BLOCK_H).load(heads_of_scores)
            acc = acc * gl.convert_layout(gl.exp2(m - m_a), heads_of_outs)[:, None]
            acc = warpgroup_mma(p_a, v_a, acc, is_async=True)  # runs under this consumer's softmax
            m_b = gl.maximum(m_a, gl.max(s, 1))
            p = gl.exp2(s - m_b[:, None])
            _publish(p, m_b, p_b, maxes.slice(BLOCK_H, BLOCK_H), sent.index(1))
            l_sum = l_sum * gl.exp2(m - m_b) + gl.sum(p, 1)
            beta = gl.exp2(m_a - m_b)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _release(empty.index(slot_a))
            acc = acc * gl.convert_layout(beta, heads_of_outs)[:, None]
        m = m_b
        acc = warpgroup_mma(p_b, v_b, acc, is_async=True)
        if c == 0 and PREFETCH:
            # past the last pair the tile does not exist: no wait, and the stale slot's scores go unused
            s = _issue_scores(q_s, qpe_s, k_ring, pe_ring, ready, 2 * j + 2, scores, 2 * j + 2 < 2 * pairs)
            acc, s = warpgroup_mma_wait(0, deps=[acc, s])
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        _release(empty.index(slot_b))

    # Both consumers' sums are relative to the same running max (consumer 0 takes consumer 1's).
    sums.slice(c * BLOCK_H, BLOCK_H).store(l_sum)
    barrier()
    mbarrier.arrive(summed.index(c))
    mbarrier.wait(summed.index(1 - c), 0)
    l_sum = l_sum + sums.slice((1 - c) * BLOCK_H, BLOCK_H).load(heads_of_scores)
    has = l_sum > 0
    inv = gl.convert_layout(1.0 / gl.where(has, l_sum, 1.0), heads_of_outs)
    o_heads = head0 + gl.arange(0, BLOCK_H, layout=heads_of_outs)
    o_cols = c * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, outs))
    mo = MidO + b * stride_mob + o_heads[:, None] * stride_moh + split * stride_mos + o_cols[None, :]
    gl.store(mo, (acc * inv[:, None]).to(MidO.dtype.element_ty), mask=(o_heads < num_heads)[:, None])
    if c == 0:
        lse2 = gl.where(has, m + gl.log2(gl.where(has, l_sum, 1.0)), float("-inf"))
        l_heads = head0 + gl.arange(0, BLOCK_H, layout=heads_of_scores)
        gl.store(MidLse + b * stride_mlb + l_heads * stride_mlh + split, lse2, mask=l_heads < num_heads)


@gluon.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target"])
def stage1_seesaw(
    Q, QPe, KV, DescLat, DescPe, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    TMA: gl.constexpr, PREFETCH: gl.constexpr,
):  # fmt: skip
    # Launched with 4 warps (the producer; the consumers are 4-warp workers), BLOCK_H = D_ROPE = 64 (p takes the
    # rope block's place), BLOCK_N = 32 (four ring slots) or 64 (two), any PAGE; with TMA, PAGE % BLOCK_N == 0 and
    # DescLat / DescPe over the cache's rows (gluon_seesaw_ring.tma_descriptors; unread without TMA).
    gl.static_assert(BLOCK_H == D_ROPE)
    gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64)
    gl.static_assert(PAGE % BLOCK_N == 0 or not TMA)  # a TMA box is one page's rows
    SLOTS: gl.constexpr = 128 // BLOCK_N  # what fits beside the queries
    b = gl.program_id(0)
    head0 = gl.program_id(1) * BLOCK_H
    split = gl.program_id(2)
    heads_1d: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    start, end = split_range(SeqLens, b, split, num_splits, split_target, BLOCK_N, heads_1d)
    if start >= end:  # past this sequence's share of splits: an empty LSE, which the merge skips
        store_empty_lse(MidLse, b, head0, split, num_heads, stride_mlb, stride_mlh, BLOCK_H, heads_1d)
        return
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = KV.dtype.element_ty
    q_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_LAT], smem)
    qpe_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], smem)
    k_ring = gl.allocate_shared_memory(dtype, [SLOTS, BLOCK_N, D_LAT], smem)
    pe_ring = gl.allocate_shared_memory(dtype, [SLOTS, BLOCK_N, D_ROPE], smem)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    maxes = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # m after tile a, after tile b
    sums = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # each consumer's row sums, at the end
    bars: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], bars)
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], bars)
    sent = gl.allocate_shared_memory(gl.int64, [2, 1], bars)  # consumer c's p and max are in place
    summed = gl.allocate_shared_memory(gl.int64, [2, 1], bars)  # consumer c's row sums are in place
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bars)
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers read every slot
    for i in gl.static_range(2):
        mbarrier.init(sent.index(i), count=1)
        mbarrier.init(summed.index(i), count=1)
    mbarrier.init(q_ready, count=1)
    fence_async_shared()  # the initialized barriers, before the copies' arrivals
    barrier()
    gl.warp_specialize(
        [
            (producer, (Q, QPe, KV, DescLat, DescPe, BlockTable, start, end, b, head0, num_heads, stride_qb,
                         stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, q_s, qpe_s, k_ring, pe_ring, q_ready,
                         ready, empty, PAGE, D_LAT, D_ROPE, BLOCK_N, TMA)),
            (_consumer, (0, start, end, b, head0, split, num_heads, scale_log2, MidO, MidLse, stride_mob,
                          stride_moh, stride_mos, stride_mlb, stride_mlh, q_s, qpe_s, k_ring, pe_ring, q_ready, ready,
                          empty, sent, maxes, sums, summed, PREFETCH)),
            (_consumer, (1, start, end, b, head0, split, num_heads, scale_log2, MidO, MidLse, stride_mob,
                          stride_moh, stride_mos, stride_mlb, stride_mlh, q_s, qpe_s, k_ring, pe_ring, q_ready, ready,
                          empty, sent, maxes, sums, summed, PREFETCH)),
        ],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
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
    """The table entry's launch: the split step at the plan's tile (64 heads, plan.block_n rows; the producer's 4
    warps beside the consumers' 8), then the merge. Whole tiles come by TMA where the plan asks for it and the
    cache's rows are 16-byte aligned, else by cp.async (the kernel then reads no descriptor: they are built over a
    small aligned stand-in)."""
    step = split_step(plan, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    d_rope = q_pe.shape[-1]
    use_tma = plan.tma and tma_rows(kv_cache)
    rows = (
        step.kv
        if use_tma
        else torch.empty(plan.block_n, step.kv.shape[-1], dtype=kv_cache.dtype, device=q.device)
    )
    q_args = step.args(q, q_pe)
    stage1_seesaw[step.grid](
        *q_args[:3], *tma_descriptors(rows, kv_lora_rank, d_rope, plan.block_n), *q_args[3:],
        PAGE=kv_cache.shape[1], D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=plan.block_h, BLOCK_N=plan.block_n,
        TMA=use_tma, PREFETCH=plan.prefetch, num_warps=4,
    )  # fmt: skip
    return merge(plan, step, q, seq_lens, kv_lora_rank)
