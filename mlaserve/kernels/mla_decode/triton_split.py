"""Triton paged MLA decode: absorbed queries attend over the latent cache, split-KV with an LSE merge.

Each program takes one sequence, a group of BLOCK_H query heads and one slice of the context ("split"), so a
latent row is read from HBM once per head group and the heads share it through tensor-core dots. With balanced
spans (DecodePlan.balanced: 16 heads per program over a 16-bit cache, batches of about 41 sequences or more) a
program instead takes an equal run of the batch's tiles laid end to end, over as many sequences as the run
touches, so a batch of uneven lengths does not wait on the slices of its longest sequences. The nope part
(kv_lora_rank) and the rope part (qk_rope_head_dim) of the row are loaded side by side and their two dots summed;
the value is the nope part itself. Stage 2 merges the splits by their log-sum-exp; the merged LSE is returned so
callers can merge further partial results (chunked context, sparse attention).

The Triton kernel takes any shape: tl.arange needs powers of two and tl.dot dimensions of 16 or more, so the latent
and rope parts are loaded as tiles padded to LAT_TILE and ROPE_TILE (powers of two, at least 16) with the columns
past the true width masked, and heads come in groups of at least 16 with the heads past num_heads masked. Padded
columns load as zeros, which add nothing to the dots, and are never stored. At DeepSeek's widths (512 + 64) the
tiles are the widths and the masks are the row masks alone: the compiled kernel is the one it was before padding.

Which kernel runs a call is dispatch.py's table: on Hopper, the Gluon split steps in mla_decode_wgmma.py (64 heads
per program), mla_decode_wgmma8.py and mla_decode_fp8.py (8-bit caches at 16 heads) where they fit and pay; this
kernel elsewhere, and it stays their reference on CPU under the interpreter and on other GPUs. `mla_decode` is the
engine's entry (the dispatcher's choice, nothing to tune); `mla_decode_tuned` names a kernel and its tuning knobs
for benchmarks; `decode_plan` says what a call would run.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fit import first_that_builds
from mlaserve.kernels.mla_decode import dispatch
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodePlan, DecodeShape
from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.kvcache.quant import is_quantized

LOG2E = 1.4426950408889634


@triton.jit
def _mask(rows_ok, cols, D: tl.constexpr, TILE: tl.constexpr):
    """The load/store mask of a [rows, TILE] tile: rows_ok, and where TILE pads the width D, the columns below D."""
    if TILE == D:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (cols < D)[None, :]


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
    k = tl.load(row + lat[None, :], mask=_mask(ok, lat, D_LAT, LAT_TILE), other=0.0)
    k_pe = tl.load(row + D_LAT + rope[None, :], mask=_mask(ok, rope, D_ROPE, ROPE_TILE), other=0.0)
    if QUANTIZED:  # 8-bit row: values, then the row's float32 scale (kvcache/quant.py)
        scale = tl.load((base + D_LAT + D_ROPE).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    else:
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return k, k_pe, scale


@triton.jit
def _load_tile(
    KV, BlockTable, b, n0, end, stride_kv, stride_bt,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr, TILE_IN_PAGE: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr,
):  # fmt: skip
    """Rows n0 .. n0 + BLOCK_N of sequence b (masked past `end`): latent part, rope part, the 8-bit row scales."""
    pos = n0 + tl.arange(0, BLOCK_N)
    ok = pos < end
    if TILE_IN_PAGE:  # the tile is one run of rows inside a page: one table lookup, contiguous rows
        page = _page_of(BlockTable, b, n0, end, stride_bt, PAGE)
        base = _rows_in_page(KV, page, n0, stride_kv, PAGE, BLOCK_N)
    else:
        page = tl.load(BlockTable + b * stride_bt + pos // PAGE, mask=ok, other=0)
        base = KV + (page.to(tl.int64) * PAGE + pos % PAGE) * stride_kv
    k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED, LAT_TILE, ROPE_TILE)
    return k, k_pe, scale, ok


@triton.jit
def _widen_bits(x, out_dtype: tl.constexpr):
    """8-bit values -> fp16 by integer operations, off the conversion unit: fp8_e4m3 s.eeee.mmm placed as fp16
    s.0eeee.mmm0000000 is x * 2^-8 (subnormals too); int8 v as fp16 0x6400 | (v + 128) is 1,024 + 128 + v."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    if x.dtype == tl.int8:
        return (((b ^ 0x80) | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(out_dtype)
    return ((((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0).to(out_dtype)


@triton.jit
def _attend_tile(
    q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, WIDEN_BITS: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a tile; returns the updated (max, sum, accumulator)."""
    if QUANTIZED:
        # The scale is per token, i.e. per score column: apply it to the scores and to p, not to the tile.
        if WIDEN_BITS:
            k = _widen_bits(k, q.dtype)
            k_pe = _widen_bits(k_pe, q.dtype)
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
def _split_span(SeqLens, b, split, num_splits, split_target, BLOCK_N: tl.constexpr):
    """Rows [start, end) of sequence b that split `split` covers (empty past the sequence's share of splits).

    The batch takes batch x split_target splits, each sequence its share by length: round(split_target x its length
    / the mean length), at least 1 and at most num_splits (the grid's), its rows spread evenly over them in whole
    tiles. Equal lengths take split_target each, as the measured rules do; a sequence four times the mean length
    takes four times as many, so it does not run alone at the end. A CUDA graph sizes the grid for max_model_len
    (decode_rules.grid_splits), so the lengths are read here: all of them, from the device."""
    seq_len = tl.load(SeqLens + b)
    batch = tl.num_programs(0)
    idx = tl.arange(0, 512)
    total = tl.sum(tl.load(SeqLens + idx, mask=idx < batch, other=0), 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        total += tl.sum(tl.load(SeqLens + i + idx, mask=i + idx < batch, other=0), 0)
    # round(split_target x seq_len / mean length), in float32: exact for equal lengths, no 64-bit products
    mean = tl.maximum(total, 1).to(tl.float32) / batch
    share = (seq_len.to(tl.float32) * split_target / mean + 0.5).to(tl.int32)
    count = tl.minimum(tl.maximum(share, 1), num_splits)
    split_len = tl.cdiv(tl.cdiv(seq_len, count), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _tiles_of(SeqLens, i, batch, BLOCK_N: tl.constexpr):
    """Tiles of BLOCK_N rows of sequences i .. i + 511 (0 past the batch), and which of them are in the batch."""
    idx = tl.arange(0, 512)
    ok = i + idx < batch
    return tl.cdiv(tl.load(SeqLens + i + idx, mask=ok, other=0), BLOCK_N), ok


@triton.jit
def _per_program(total, num_ctas, MIN_TILES: tl.constexpr):
    """Balanced spans: how many of the batch's `total` tiles each program takes, an equal share, at least
    MIN_TILES."""
    return tl.maximum(tl.cdiv(total, num_ctas), MIN_TILES)


@triton.jit
def _program_span(SeqLens, batch, cta, num_ctas, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Program cta's span of the batch's tiles laid end to end, [t0, t1), the first sequence it touches, the tiles
    before that one, and the end of the sequences it touches (exclusive; sequences of no rows touch nothing). The
    first 512 lengths are read once, for both the total and the search."""
    tiles, ok = _tiles_of(SeqLens, 0, batch, BLOCK_N)
    total = tl.sum(tiles, 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        more, _ = _tiles_of(SeqLens, i, batch, BLOCK_N)
        total += tl.sum(more, 0)
    per = _per_program(total, num_ctas, MIN_TILES)
    t0 = cta * per
    t1 = tl.minimum(t0 + per, total)
    ends = tl.cumsum(tiles, 0)
    done = ok & (ends <= t0)
    first = tl.sum(done.to(tl.int32), 0)
    before = tl.sum(tl.where(done, tiles, 0), 0)
    stop = tl.sum((ok & (ends < t1)).to(tl.int32), 0) + 1
    run = tl.sum(tiles, 0)
    for i in range(512, batch, 512):
        tiles, ok = _tiles_of(SeqLens, i, batch, BLOCK_N)
        ends = run + tl.cumsum(tiles, 0)
        done = ok & (ends <= t0)
        first += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, tiles, 0), 0)
        stop += tl.sum((ok & (ends < t1)).to(tl.int32), 0)
        run += tl.sum(tiles, 0)
    return t0, t1, first, before, stop


@triton.jit
def _sequence_programs(SeqLens, batch, b, num_ctas, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """The first program whose balanced span touches sequence b, and how many do (0 for no rows)."""
    tiles, ok = _tiles_of(SeqLens, 0, batch, BLOCK_N)
    idx = tl.arange(0, 512)
    total = tl.sum(tiles, 0)
    before = tl.sum(tl.where(idx < b, tiles, 0), 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        more, _ = _tiles_of(SeqLens, i, batch, BLOCK_N)
        total += tl.sum(more, 0)
        before += tl.sum(tl.where(i + idx < b, more, 0), 0)
    per = _per_program(total, num_ctas, MIN_TILES)
    own = tl.cdiv(tl.load(SeqLens + b), BLOCK_N)
    first = before // per
    return first, tl.where(own > 0, (before + own - 1) // per - first + 1, 0)


@triton.jit
def _attend_rows(
    Q, QPe, KV, BlockTable, b, start, end, heads, head_ok, d, r, q_ok,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, scale_log2,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr,
):  # fmt: skip
    """Sequence b's heads attend over its rows [start, end): the partial output and base-2 LSE (-inf if empty)."""
    # Masked by the span's bounds, every program's query loads waited for the lengths' sum, and the 16-head kernel
    # took 347.7 us at (128, 16, 8,192) where it takes 305.7 and 306.5 us without
    # (results/h200-split-room-2026-12-02-{d5d257c,b90320a,3d1425f}.json, H200s): an empty span loads them too.
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    q_pe = tl.load(
        QPe + b * stride_pb + heads[:, None] * stride_ph + r[None, :],
        mask=_mask(head_ok, r, D_ROPE, ROPE_TILE),
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
            KV, BlockTable, b, start, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
            TILE_IN_PAGE, LAT_TILE, ROPE_TILE,
        )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            k_next, kpe_next, scale_next, ok_next = _load_tile(
                KV, BlockTable, b, n0 + BLOCK_N, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N,
                QUANTIZED, TILE_IN_PAGE, LAT_TILE, ROPE_TILE,
            )  # fmt: skip
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
            k, k_pe, scale, ok = k_next, kpe_next, scale_next, ok_next
    elif PAGE_AHEAD:
        # The page of tile i + 1 is looked up while tile i is worked on. With the lookup in the same iteration as
        # the tile's load, Triton's pipeliner spends a stage on it and gives the tile one shared-memory buffer
        # (as compiled for sm_90, benchmarks/diagnose/decode_compile_report.py); one tile ahead, the tile gets two.
        page = _page_of(BlockTable, b, start, end, stride_bt, PAGE)
        for n0 in range(start, end, BLOCK_N):
            page_next = _page_of(BlockTable, b, n0 + BLOCK_N, end, stride_bt, PAGE)
            ok = n0 + tl.arange(0, BLOCK_N) < end
            base = _rows_in_page(KV, page, n0, stride_kv, PAGE, BLOCK_N)
            k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED, LAT_TILE, ROPE_TILE)
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
            page = page_next
    else:
        for n0 in range(start, end, BLOCK_N):
            k, k_pe, scale, ok = _load_tile(
                KV, BlockTable, b, n0, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
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
    Q, QPe, KV, BlockTable, MidO, MidLse, b, start, end, row, split, heads, head_ok, d, r, q_ok,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh, scale_log2,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr, LAT_TILE: tl.constexpr, ROPE_TILE: tl.constexpr, EMPTY_LSE: tl.constexpr,
):  # fmt: skip
    """Sequence b's rows [start, end) into partial `row`, split `split`. An empty span stores no output, and its LSE
    (-inf) only where EMPTY_LSE: split shares' merge reads every split's, balanced spans' only those with rows."""
    out, lse2 = _attend_rows(
        Q, QPe, KV, BlockTable, b, start, end, heads, head_ok, d, r, q_ok,
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
@triton.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits", "split_target", "batch"])
def _stage1(
    Q, QPe, KV, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits, split_target, batch,
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
    q_ok = _mask(head_ok, d, D_LAT, LAT_TILE)
    if BALANCED:
        # Program c takes tiles [c x per, (c + 1) x per) of the batch's tiles laid end to end, over as many
        # sequences as they touch: every program the same rows, whatever the lengths. Its partial for sequence b
        # goes to row b + c: a sequence's programs are consecutive, so the rows are distinct and the merge finds
        # them from the lengths alone (num_splits: the programs; MidO [batch + num_splits, heads, 1, latent]).
        cta = tl.program_id(0)
        t0, t1, first, seg, stop = _program_span(SeqLens, batch, cta, num_splits, BLOCK_N, MIN_TILES)
        for b in range(first, tl.where(t0 < t1, stop, first)):
            seq_len = tl.load(SeqLens + b)
            tiles = tl.cdiv(seq_len, BLOCK_N)
            start = (tl.maximum(t0, seg) - seg) * BLOCK_N
            end = tl.minimum((tl.minimum(t1, seg + tiles) - seg) * BLOCK_N, seq_len)
            _partial(
                Q, QPe, KV, BlockTable, MidO, MidLse, b, start, end, b + cta, 0, heads, head_ok, d, r, q_ok,
                stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
                stride_mlb, stride_mlh, scale_log2, PAGE, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, PRECISION, QUANTIZED,
                TILE_IN_PAGE, PREFETCH, Q_F16, PAGE_AHEAD, WIDEN_BITS, LAT_TILE, ROPE_TILE, False,
            )  # fmt: skip
            seg += tiles
    else:
        b = tl.program_id(0)
        split = tl.program_id(2)
        start, end = _split_span(SeqLens, b, split, num_splits, split_target, BLOCK_N)
        # A split past its sequence's share is empty: its tile loop runs no step, and it stores only its LSE
        # (-inf), which the merge skips.
        _partial(
            Q, QPe, KV, BlockTable, MidO, MidLse, b, start, end, b, split, heads, head_ok, d, r, q_ok,
            stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos,
            stride_mlb, stride_mlh, scale_log2, PAGE, D_LAT, D_ROPE, BLOCK_H, BLOCK_N, PRECISION, QUANTIZED,
            TILE_IN_PAGE, PREFETCH, Q_F16, PAGE_AHEAD, WIDEN_BITS, LAT_TILE, ROPE_TILE, True,
        )  # fmt: skip


@triton.jit(do_not_specialize=["stride_mlh", "num_splits", "batch"])
def _stage2(
    MidO, MidLse, Out, Lse, SeqLens,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, stride_lb,
    num_splits, batch,
    D_LAT: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, LAT_TILE: tl.constexpr,
    BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    # Launched early behind the split step (pdl.py): wait until that grid has finished and its partials are visible.
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, LAT_TILE)
    if BALANCED:
        # Sequence b's partials are rows b + c of the programs c whose spans touch it (_stage1), in blocks of
        # BLOCK_S, merged online.
        first, count = _sequence_programs(SeqLens, batch, b, num_splits, BLOCK_N, MIN_TILES)
        top = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        out = tl.zeros([LAT_TILE], tl.float32)
        for j in range(0, count, BLOCK_S):
            ok = j + s < count
            row = b + first + j + s
            lse2 = tl.load(MidLse + row * stride_mlb + h * stride_mlh, mask=ok, other=float("-inf"))
            new_top = tl.maximum(top, tl.max(lse2, 0))  # finite: every stored partial has rows
            alpha = tl.exp2(top - new_top)
            w = tl.where(ok, tl.exp2(lse2 - new_top), 0.0)
            parts = tl.load(
                MidO + row[:, None] * stride_mob + h * stride_moh + d[None, :],
                mask=_mask(ok, d, D_LAT, LAT_TILE),
                other=0.0,
            ).to(tl.float32)
            out = out * alpha + tl.sum(parts * w[:, None], 0)
            total = total * alpha + tl.sum(w, 0)
            top = new_top
        out = out / tl.where(total > 0, total, 1.0)
    else:
        s_ok = s < num_splits
        lse2 = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse2, 0)
        w = tl.where(s_ok, tl.exp2(lse2 - top), 0.0)
        total = tl.sum(w, 0)
        # Splits past a sequence's share are empty (LSE -inf) and may not have written their partial output.
        parts = tl.load(
            MidO + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
            mask=_mask(s_ok & (lse2 > float("-inf")), d, D_LAT, LAT_TILE),
            other=0.0,
        ).to(tl.float32)
        out = tl.sum(parts * (w / total)[:, None], 0)
    if LAT_TILE == D_LAT:
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
    else:
        tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D_LAT)
    tl.store(Lse + b * stride_lb + h, (top + tl.log2(total)) / 1.4426950408889634)


def _tma_rows(kv_cache: torch.Tensor) -> bool:
    """Whether TMA can copy the cache's rows: 16-byte aligned start and row stride, unit stride within a row."""
    row = kv_cache.view(-1, kv_cache.shape[-1])
    return row.stride(1) == 1 and row.stride(0) * row.element_size() % 16 == 0 and row.data_ptr() % 16 == 0


def decode_plan(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    d_rope: int,
    kernel: str | None = None,
    **tuning: object,
) -> DecodePlan:
    """What a decode call over q ([B, H, ...]) and kv_cache would launch: the dispatcher's kernel, or `kernel`
    (a name in dispatch.DECODE_KERNELS; ValueError where it cannot run), with `tuning` over its defaults."""
    return decode_ladder(q, kv_cache, max_seq_len, kv_lora_rank, d_rope, kernel, **tuning)[0]


def decode_ladder(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    d_rope: int,
    kernel: str | None = None,
    **tuning: object,
) -> tuple[DecodePlan, ...]:
    """decode_plan's plan, then (the engine's call only) the plans that run the call if it cannot be built on this
    device (dispatch.default_ladder); a named kernel or tuning is that plan alone."""
    shape = DecodeShape(q.shape[1], kv_lora_rank, d_rope, kv_cache.dtype, q.dtype, kv_cache.shape[1])
    device = dispatch.decode_device(q.device)
    tma_rows = not device.gluon or kv_cache.dtype != torch.float8_e4m3fn or _tma_rows(kv_cache)
    call = DecodeCall(q.shape[0], max_seq_len, tma_rows)
    if kernel is None and not tuning:
        return dispatch.default_ladder(shape, call, device)
    return (dispatch.plan(shape, call, device, kernel, **tuning),)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
    q_pe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache, by the kernel dispatch.py picks for the call.

    q: [B, H, kv_lora_rank + rope], or [B, H, kv_lora_rank] with the rope part in q_pe [B, H, rope] (views of
    other tensors are fine, only the last dimension must be contiguous); kv_cache: [blocks, page, 1, kv_lora_rank +
    rope] (8-bit rows: then the 16-byte scale tail, kvcache/quant.py); block_table [B, max_blocks]; seq_lens [B];
    max_seq_len: the longest context the call is sized for (sets the split count). Returns (out [B, H,
    kv_lora_rank] in q's dtype, lse [B, H] float32, natural log)."""
    return mla_decode_tuned(q, kv_cache, block_table, seq_lens, max_seq_len, kv_lora_rank, scale, q_pe)


def mla_decode_tuned(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
    q_pe: torch.Tensor | None = None,
    kernel: str | None = None,
    **tuning: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode for benchmarks: `kernel` names the split step (dispatch.DECODE_KERNELS: "gluon_fp8",
    "gluon_wgmma8", "gluon_wgmma", "triton", "torch reference"; None: the dispatcher's) and `tuning` sets the knobs
    that kernel lists (ValueError for others):

    - all but the torch reference: num_splits (the grid's context slices), partial_dtype (how the per-split
      partial outputs are stored for the merge; bf16 was no faster than float32 in the sweep).
    - "triton": block_h (heads per program), block_n (rows per tile), num_warps, num_stages; prefetch (load the
      next tile into registers before working on this one; default on for 8-bit caches, whose tiles are converted
      in registers, where Triton's pipeliner cannot stream them); page_ahead (look the next tile's page up while
      working on this one, so the pipeliner gives the tile two shared-memory buffers; default on at 16 heads per
      program with 16-bit caches); q_f16 (8-bit caches: fp16 dots instead of bf16, a cheaper widening; default on
      at 16 heads per program with a 16-bit q); widen_bits (8-bit caches with fp16 dots: widen by integer
      operations instead of conversion instructions; exact for every byte, 5-7% faster for fp8 and 11-12% for
      int8 at the memory-bound shapes on an H200).
    - "gluon_fp8": pdl (launch the split step and the merge with programmatic dependent launch, each behind the
      kernel before it; default on: at (64, 16, 4,096) 53 us against 55 us launched plainly). Its query goes in as
      two e4m3 terms, about bf16's precision; what remains is the fp8 tensor cores' accumulation: on an H200, at
      four shapes, LSEs within 1.4e-3 of the torch reference over the dequantized cache (the widening kernel:
      2e-6), outputs within 4.4e-3 (widening: 4.0e-3), where the cache's own fp8 rounding moved that reference by
      3e-3 to 3e-2 in LSE."""
    if q_pe is None:
        q, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    q, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, q_pe))
    plans = decode_ladder(q, kv_cache, max_seq_len, kv_lora_rank, q_pe.shape[-1], kernel, **tuning)
    return first_that_builds(
        "mla_decode",
        plans,
        lambda plan: launch(plan, q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale),
    )


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
    """Run `plan` (decode_plan) over q [B, H, kv_lora_rank] and q_pe [B, H, rope], last dimensions contiguous."""
    if plan.kernel == "torch reference":
        from mlaserve.attention.torch_ref import paged_latent_decode

        return paged_latent_decode(q, q_pe, kv_cache, block_table, seq_lens, kv_lora_rank, scale)
    batch, heads, _ = q.shape
    num_splits = plan.num_splits
    page = kv_cache.shape[1]
    d_rope = q_pe.shape[-1]
    row = kv_cache.shape[-1]  # width, or width + a 16-byte scale tail for 8-bit rows
    # Balanced spans keep one partial row per (program, sequence) pair it touches (_stage1): batch + programs
    rows, parts = (batch + num_splits, 1) if plan.balanced else (batch, num_splits)
    mid_o = torch.empty(rows, heads, parts, kv_lora_rank, dtype=plan.partial_dtype, device=q.device)
    mid_lse = torch.empty(rows, heads, parts, dtype=torch.float32, device=q.device)
    kv = kv_cache.view(-1, row)
    tensors = (kv, block_table, seq_lens, mid_o, mid_lse)
    strides = (kv.stride(0), block_table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
               mid_lse.stride(0), mid_lse.stride(1))  # fmt: skip
    sizes = (heads, scale * LOG2E, num_splits, plan.split_target or num_splits)
    args = (q, q_pe, *tensors, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), *strides, *sizes)
    groups = triton.cdiv(heads, plan.block_h)
    grid = (num_splits, groups, 1) if plan.balanced else (batch, groups, num_splits)
    pdl = pdl_launch(q)  # the Triton split step's and the merge's launch options (pdl.py)
    if plan.kernel == "gluon_fp8":
        from mlaserve.kernels.mla_decode.fp8_query import split_queries
        from mlaserve.kernels.mla_decode.gluon_fp8 import stage1_fp8, tma_descriptors

        stage1_fp8[grid](
            *split_queries(q, q_pe, launch_dependents=plan.pdl), kv, *tma_descriptors(kv, d_rope), *tensors[1:],
            *strides, *sizes, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=16, BLOCK_N=64, PDL=plan.pdl,
            num_warps=4, **({"launch_pdl": True} if plan.pdl else {}),
        )  # fmt: skip
    elif plan.kernel == "gluon_wgmma8":
        from mlaserve.kernels.mla_decode.gluon_wgmma8 import stage1_wgmma8

        stage1_wgmma8[grid](
            *args, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=16, BLOCK_N=64, num_warps=4,
        )  # fmt: skip
    elif plan.kernel == "gluon_wgmma":
        from mlaserve.kernels.mla_decode.gluon_wgmma import stage1_wgmma

        stage1_wgmma[grid](
            *args, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=plan.block_h, BLOCK_N=plan.block_n,
            num_warps=plan.num_warps,
        )  # fmt: skip
    else:
        _stage1[grid](
            *args, batch,
            PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=plan.block_h, BLOCK_N=plan.block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=is_quantized(kv_cache.dtype),
            TILE_IN_PAGE=plan.tile_in_page, PREFETCH=plan.prefetch, Q_F16=plan.q_f16, PAGE_AHEAD=plan.page_ahead,
            WIDEN_BITS=plan.widen_bits, LAT_TILE=plan.lat_tile, ROPE_TILE=plan.rope_tile,
            BALANCED=plan.balanced, MIN_TILES=_min_tiles(plan), num_warps=plan.num_warps,
            num_stages=plan.num_stages, **pdl,
        )  # fmt: skip
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    # The fp8-dot kernel's plan may ask for PDL on its own (its tuning); every kernel takes it where pdl.py does.
    merge_pdl = (plan.pdl and plan.kernel == "gluon_fp8") or pdl["PDL"]
    # Balanced spans merge a sequence's partials 8 at a time (most have 1-3); blocks of 32 were slower at the
    # 229-sequence batch in an H200 run that was not kept as a record (3e0922f's commit message).
    _stage2[(batch, heads)](
        mid_o, mid_lse, out, lse, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), num_splits, batch,
        D_LAT=kv_lora_rank, BLOCK_S=8 if plan.balanced else triton.next_power_of_2(num_splits), PDL=merge_pdl,
        LAT_TILE=plan.lat_tile or kv_lora_rank, BALANCED=plan.balanced, BLOCK_N=plan.block_n,
        MIN_TILES=_min_tiles(plan), **({"launch_pdl": True} if merge_pdl else {}),
    )  # fmt: skip
    return out, lse


def _min_tiles(plan: DecodePlan) -> int:
    """The fewest tiles a balanced span takes."""
    return max(1, plan.min_span_rows // plan.block_n)
