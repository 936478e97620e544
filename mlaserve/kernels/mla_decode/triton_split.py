"""The Triton split step of paged MLA decode: absorbed queries attend over the latent cache, split-KV.

Each program takes one sequence, a group of BLOCK_H query heads and one slice of the context ("split"), or with
balanced spans an equal run of the batch's tiles (spans.py), so a latent row is read from HBM once per head group
and the heads share it through tensor-core dots. The nope part (kv_lora_rank) and the rope part (qk_rope_head_dim)
of the row are loaded side by side and their two dots summed; the value is the nope part itself. Each program
writes a partial output and its LSE, which partials.merge combines.

It takes any shape: tl.arange needs powers of two and tl.dot dimensions of 16 or more, so the latent and rope parts
are loaded as tiles padded to LAT_TILE and ROPE_TILE (powers of two, at least 16) with the columns past the true
width masked, and heads come in groups of at least 16 with the heads past num_heads masked. Padded columns load as
zeros, which add nothing to the dots, and are never stored. At DeepSeek's widths (512 + 64) the tiles are the
widths and the masks are the row masks alone: the compiled kernel is the one it was before padding.

Which kernel runs a call is dispatch.py's table: on Hopper, the Gluon split steps (gluon_wgmma.py for 64 heads per
program, gluon_wgmma8.py and gluon_fp8.py for 8-bit caches at 16 heads) where they fit and pay; this kernel
elsewhere, and it stays their reference on CPU under the interpreter and on other GPUs.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.mla_decode.partials import merge, min_tiles, split_step, tile_mask
from mlaserve.kernels.mla_decode.rules import DecodePlan
from mlaserve.kernels.mla_decode.spans import program_span, split_span
from mlaserve.kernels.mla_decode.widen import widen_bits
from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kvcache.quant import is_quantized


@triton.jit
def _page_of(BlockTable, b, n0, end, stride_bt, PAGE: tl.constexpr):
    """The cache page that holds row n0 of sequence b (page 0, never read, once n0 is past `end`)."""
    return tl.load(BlockTable + b * stride_bt + n0 // PAGE, mask=n0 < end, other=0).to(tl.int64)


@triton.jit
def _rows_in_page(KV, page, n0, stride_kv, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to rows n0 .. n0 + BLOCK_N of a sequence, a run that lies inside its page `page`."""
    return KV + (page * PAGE + n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_kv


@triton.jit
def _load_rows(
    base, ok, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr,
    LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr,
):  # fmt: skip
    """The rows at pointers `base` (masked by `ok`): latent part, rope part (zero-padded to their tiles), the
    8-bit row scales."""
    row = base[:, None]
    lat = tl.arange(0, LAT_TILE)
    rope = tl.arange(0, ROPE_TILE)
    k = tl.load(row + lat[None, :], mask=tile_mask(ok, lat, D_LAT, LAT_TILE), other=0.0)
    k_pe = tl.load(row + D_LAT + rope[None, :], mask=tile_mask(ok, rope, D_ROPE, ROPE_TILE), other=0.0)
    if QUANTIZED:  # 8-bit row: values, then the row's float32 scale (kvcache/quant.py)
        scale = tl.load((base + D_LAT + D_ROPE).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    else:
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return k, k_pe, scale


@triton.jit
def _load_tile(
    KV, BlockTable, b, n0, lo, end, stride_kv, stride_bt,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr, TILE_IN_PAGE: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr,
):  # fmt: skip
    """Rows n0 .. n0 + BLOCK_N of sequence b (masked before `lo` and past `end`): latent part, rope part, the 8-bit
    row scales."""
    pos = n0 + tl.arange(0, BLOCK_N)
    ok = (pos < end) & (pos >= lo)
    if TILE_IN_PAGE:  # the tile is one run of rows inside a page: one table lookup, contiguous rows
        page = _page_of(BlockTable, b, n0, end, stride_bt, PAGE)
        base = _rows_in_page(KV, page, n0, stride_kv, PAGE, BLOCK_N)
    else:
        page = tl.load(BlockTable + b * stride_bt + pos // PAGE, mask=ok, other=0)
        base = KV + (page.to(tl.int64) * PAGE + pos % PAGE) * stride_kv
    k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED, LAT_TILE, ROPE_TILE)
    return k, k_pe, scale, ok


@triton.jit
def _attend_tile(
    q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, WIDEN_BITS: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a tile; returns the updated (max, sum, accumulator)."""
    if QUANTIZED:
        # The scale is per token, i.e. per score column: apply it to the scores and to p, not to the tile.
        if WIDEN_BITS:
            k = widen_bits(k, q.dtype)
            k_pe = widen_bits(k_pe, q.dtype)
        else:
            k = k.to(q.dtype)
            k_pe = k_pe.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
    if QUANTIZED:
        s = s * scale[None, :]
    s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _attend_rows(
    Q, QPe, KV, BlockTable, b, start, lo, end, heads, head_ok, d, r, q_ok,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, scale_log2,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr,
):  # fmt: skip
    """Sequence b's heads attend over its rows [max(start, lo), end): the partial output and base-2 LSE (-inf if
    empty)."""
    # Unmasked, as an empty span loads them too: masked by the span's bounds, every program's query loads waited for
    # the lengths' sum, and the 16-head kernel was measurably slower.
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    q_pe = tl.load(
        QPe + b * stride_pb + heads[:, None] * stride_ph + r[None, :],
        mask=tile_mask(head_ok, r, D_ROPE, ROPE_TILE),
        other=0.0,
    )
    if Q_F16:  # 8-bit tiles then widen to fp16 (one instruction per pair on Hopper) rather than bf16
        q, q_pe = q.to(tl.float16), q_pe.to(tl.float16)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LAT_TILE], tl.float32)
    if PREFETCH:
        # 8-bit tiles are converted in registers before the dots, which keeps Triton's pipeliner from streaming
        # them into shared memory ahead of use; loading tile i + 1 before working on tile i hides the latency.
        k, k_pe, scale, ok = _load_tile(
            KV, BlockTable, b, start, lo, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
            TILE_IN_PAGE, LAT_TILE, ROPE_TILE,
        )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            k_next, kpe_next, scale_next, ok_next = _load_tile(
                KV, BlockTable, b, n0 + BLOCK_N, lo, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N,
                QUANTIZED, TILE_IN_PAGE, LAT_TILE, ROPE_TILE,
            )  # fmt: skip
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
            k, k_pe, scale, ok = k_next, kpe_next, scale_next, ok_next
    elif PAGE_AHEAD:
        # The page of tile i + 1 is looked up while tile i is worked on. With the lookup in the same iteration as
        # the tile's load, Triton's pipeliner spends a stage on it and gives the tile one shared-memory buffer
        # (as compiled for sm_90); one tile ahead, the tile gets two.
        page = _page_of(BlockTable, b, start, end, stride_bt, PAGE)
        for n0 in range(start, end, BLOCK_N):
            page_next = _page_of(BlockTable, b, n0 + BLOCK_N, end, stride_bt, PAGE)
            ok = (n0 + tl.arange(0, BLOCK_N) < end) & (n0 + tl.arange(0, BLOCK_N) >= lo)
            base = _rows_in_page(KV, page, n0, stride_kv, PAGE, BLOCK_N)
            k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED, LAT_TILE, ROPE_TILE)
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
            page = page_next
    else:
        for n0 in range(start, end, BLOCK_N):
            k, k_pe, scale, ok = _load_tile(
                KV, BlockTable, b, n0, lo, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
                TILE_IN_PAGE, LAT_TILE, ROPE_TILE,
            )  # fmt: skip
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse2 = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    return out, lse2


@triton.jit
def _partial(
    Q, QPe, KV, BlockTable, MidO, MidLse, b, start, lo, end, row, split, heads, head_ok, d, r, q_ok,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh, scale_log2,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr, EMPTY_LSE: tl.constexpr,
):  # fmt: skip
    """Sequence b's rows [max(start, lo), end) into partial `row`, split `split`. An empty span stores no output, and
    its LSE (-inf) only where EMPTY_LSE: split shares' merge reads every split's, balanced spans' only those with
    rows."""
    out, lse2 = _attend_rows(
        Q, QPe, KV, BlockTable, b, start, lo, end, heads, head_ok, d, r, q_ok,
        stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, scale_log2,
        PAGE, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, PRECISION, QUANTIZED, TILE_IN_PAGE, PREFETCH, Q_F16,
        PAGE_AHEAD, WIDEN_BITS, LAT_TILE, ROPE_TILE,
    )  # fmt: skip
    some = lse2 > float("-inf")
    mo = MidO + row * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :]
    tl.store(mo, out.to(MidO.dtype.element_ty), mask=q_ok & some[:, None])
    tl.store(MidLse + row * stride_mlb + heads * stride_mlh + split, lse2, mask=head_ok & (some | EMPTY_LSE))


# Ints that change from step to step are not specialized on (Triton would compile a variant for 1 and for
# multiples of 16): a compile in the middle of serving costs about a second. The per-head LSE stride is the split
# count, which an eager mixed step picks from its own batch.
@triton.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target", "batch", "window"])
def _stage1(
    Q, QPe, KV, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target, batch, window,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr, PDL: tl.constexpr,
    BALANCED: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)  # the cache row of this step's token comes from the kernel before (pdl.py)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    d = tl.arange(0, LAT_TILE)
    r = tl.arange(0, ROPE_TILE)
    q_ok = tile_mask(head_ok, d, D_LAT, LAT_TILE)
    if BALANCED:
        # Program c takes tiles [c x per, (c + 1) x per) of the batch's tiles laid end to end, over as many
        # sequences as they touch: every program the same rows, whatever the lengths. Its partial for sequence b
        # goes to row b + c: a sequence's programs are consecutive, so the rows are distinct and the merge finds
        # them from the lengths alone (num_splits: the programs; MidO [batch + num_splits, heads, 1, latent]).
        cta = tl.program_id(0)
        t0, t1, first, seg, stop = program_span(SeqLens, batch, cta, num_splits, BLOCK_N, MIN_TILES)
        for b in range(first, tl.where(t0 < t1, stop, first)):
            seq_len = tl.load(SeqLens + b)
            tiles = tl.cdiv(seq_len, BLOCK_N)
            start = (tl.maximum(t0, seg) - seg) * BLOCK_N
            end = tl.minimum((tl.minimum(t1, seg + tiles) - seg) * BLOCK_N, seq_len)
            _partial(
                Q, QPe, KV, BlockTable, MidO, MidLse, b, start, 0, end, b + cta, 0, heads, head_ok, d, r, q_ok,
                stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
                stride_mlb, stride_mlh, scale_log2, PAGE, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, PRECISION, QUANTIZED,
                TILE_IN_PAGE, PREFETCH, Q_F16, PAGE_AHEAD, WIDEN_BITS, LAT_TILE, ROPE_TILE, False,
            )  # fmt: skip
            seg += tiles
    else:
        b = tl.program_id(0)
        split = tl.program_id(2)
        start, end, lo = split_span(SeqLens, b, split, num_splits, split_target, window, BLOCK_N)
        # A split past its sequence's share is empty: its tile loop runs no step, and it stores only its LSE
        # (-inf), which the merge skips.
        _partial(
            Q, QPe, KV, BlockTable, MidO, MidLse, b, start, lo, end, b, split, heads, head_ok, d, r, q_ok,
            stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
            stride_mlb, stride_mlh, scale_log2, PAGE, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, PRECISION, QUANTIZED,
            TILE_IN_PAGE, PREFETCH, Q_F16, PAGE_AHEAD, WIDEN_BITS, LAT_TILE, ROPE_TILE, True,
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
    """The table entry's launch: `plan` over q [B, H, kv_lora_rank] and q_pe [B, H, rope], then the merge."""
    step = split_step(plan, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    _stage1[step.grid](
        *step.args(q, q_pe), q.shape[0], plan.window,
        PAGE=kv_cache.shape[1], D_LAT=kv_lora_rank, D_ROPE=q_pe.shape[-1], BLOCK_H=plan.block_h,
        BLOCK_N=plan.block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QUANTIZED=is_quantized(kv_cache.dtype), TILE_IN_PAGE=plan.tile_in_page, PREFETCH=plan.prefetch,
        Q_F16=plan.q_f16, PAGE_AHEAD=plan.page_ahead, WIDEN_BITS=plan.widen_bits, LAT_TILE=plan.lat_tile,
        ROPE_TILE=plan.rope_tile, BALANCED=plan.balanced, MIN_TILES=min_tiles(plan), num_warps=plan.num_warps,
        num_stages=plan.num_stages, **pdl_launch(q),
    )  # fmt: skip
    return merge(plan, step, q, seq_lens, kv_lora_rank)
