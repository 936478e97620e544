"""Triton paged MLA decode: absorbed queries attend over the latent cache, split-KV with an LSE merge.

Each program takes one sequence, a group of BLOCK_H query heads and one slice of the context ("split"), so a
latent row is read from HBM once per head group and the heads share it through tensor-core dots. The nope part
(kv_lora_rank) and the rope part (qk_rope_head_dim) of the row are loaded side by side and their two dots summed;
the value is the nope part itself. Stage 2 merges the splits by their log-sum-exp; the merged LSE is returned so
callers can merge further partial results (chunked context, sparse attention). On Hopper, calls with 64 heads per
program run the split step as the Gluon kernel in mla_decode_wgmma.py (see `wgmma` below), and fp8 caches at 16
heads as the one in mla_decode_fp8.py (`fp8_dots`); `decode_plan` says which runs. This kernel stays their
reference, on CPU under the interpreter and on other GPUs.
"""

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mlaserve.kvcache.quant import is_quantized

LOG2E = 1.4426950408889634


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
    base, ok, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr
):  # fmt: skip
    """The rows at pointers `base` (masked by `ok`): latent part, rope part, the 8-bit row scales."""
    row = base[:, None]
    k = tl.load(row + tl.arange(0, D_LAT)[None, :], mask=ok[:, None], other=0.0)
    k_pe = tl.load(row + D_LAT + tl.arange(0, D_ROPE)[None, :], mask=ok[:, None], other=0.0)
    if QUANTIZED:  # 8-bit row: values, then the row's float32 scale (kvcache/quant.py)
        scale = tl.load((base + D_LAT + D_ROPE).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    else:
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    return k, k_pe, scale


@triton.jit
def _load_tile(
    KV, BlockTable, b, n0, end, stride_kv, stride_bt,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
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
    k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED)
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


# Ints that change from step to step are not specialized on (Triton would compile a variant for 1 and for
# multiples of 16): a compile in the middle of serving costs about a second. The per-head LSE stride is the split
# count, which an eager mixed step picks from its own batch.
@triton.jit(do_not_specialize=["stride_bt", "stride_mlh", "num_splits"])
def _stage1(
    Q, QPe, KV, BlockTable, SeqLens, MidO, MidLse,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, scale_log2, num_splits,
    PAGE: tl.constexpr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PREFETCH: tl.constexpr, Q_F16: tl.constexpr, PAGE_AHEAD: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    seq_len = tl.load(SeqLens + b)
    # Each sequence spreads its own length over the splits: a CUDA graph sizes the split count for max_model_len,
    # and slicing by that length would leave a short sequence's whole context to one or two programs.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    d = tl.arange(0, D_LAT)
    r = tl.arange(0, D_ROPE)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    q_pe = tl.load(
        QPe + b * stride_pb + heads[:, None] * stride_ph + r[None, :], mask=head_ok[:, None], other=0.0
    )
    if Q_F16:  # 8-bit tiles then widen to fp16 (one instruction per pair on Hopper) rather than bf16
        q, q_pe = q.to(tl.float16), q_pe.to(tl.float16)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
    if PREFETCH:
        # 8-bit tiles are converted in registers before the dots, which keeps Triton's pipeliner from streaming
        # them into shared memory ahead of use; loading tile i + 1 before working on tile i hides the latency.
        k, k_pe, scale, ok = _load_tile(
            KV, BlockTable, b, start, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
            TILE_IN_PAGE,
        )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            k_next, kpe_next, scale_next, ok_next = _load_tile(
                KV, BlockTable, b, n0 + BLOCK_N, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N,
                QUANTIZED, TILE_IN_PAGE,
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
            k, k_pe, scale = _load_rows(base, ok, D_LAT, D_ROPE, BLOCK_N, QUANTIZED)
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )
            page = page_next
    else:
        for n0 in range(start, end, BLOCK_N):
            k, k_pe, scale, ok = _load_tile(
                KV, BlockTable, b, n0, end, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N, QUANTIZED,
                TILE_IN_PAGE,
            )  # fmt: skip
            m, l_sum, acc = _attend_tile(
                q, q_pe, k, k_pe, scale, ok, m, l_sum, acc, scale_log2, PRECISION, QUANTIZED, WIDEN_BITS
            )

    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse2 = tl.where(
        has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf")
    )  # base-2 LSE; -inf for an empty split
    mo = MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :]
    tl.store(mo, out.to(MidO.dtype.element_ty), mask=head_ok[:, None])
    tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse2, mask=head_ok)


@triton.jit(do_not_specialize=["stride_mlh", "num_splits"])
def _stage2(
    MidO, MidLse, Out, Lse,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, stride_lb,
    num_splits,
    D_LAT: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Launched early behind a split step that let it (the fp8-dot kernel): wait until that grid has finished and its
    # partials are visible.
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse2 = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse2, 0)
    w = tl.where(s_ok, tl.exp2(lse2 - top), 0.0)
    total = tl.sum(w, 0)
    d = tl.arange(0, D_LAT)
    parts = tl.load(
        MidO + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    out = tl.sum(parts * (w / total)[:, None], 0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
    tl.store(Lse + b * stride_lb + h, (top + tl.log2(total)) / 1.4426950408889634)


def num_splits_for(batch: int, head_groups: int, max_len: int, block_n: int, sms: int, block_h: int) -> int:
    """How many slices of the context each (sequence, head group) is split into; no slice under 4 KV tiles.

    The memory-bound kernel (16 heads per program) gets about two programs per SM, which is what fits at once. On
    an H200, block 64, 16 heads, timed as CUDA-graph replays (two rounds within 1%): (B, L) = (64, 4,096) took
    0.098 ms at 4 splits, 0.104 at 8, 0.115 at 3, 0.119 at 6 and 0.130 at 2; (128, 8,192) took 0.322 ms at 2,
    0.326 at 4 and 0.399 at 3. (Eager timings of the same kernel had spread 0.099-0.174 ms between runs: host
    launch time.) The compute-bound kernel (64 heads per program) was fastest unsplit when one wave holds every
    program, so it takes the fewest splits whose last wave is within 5% of the best fill."""
    most = max(1, min(math.ceil(max_len / (4 * block_n)), 64))
    work = max(batch * head_groups, 1)
    if block_h <= 16:
        return max(1, min(most, round(2 * sms / work)))

    def fill(splits: int) -> float:
        programs = work * splits
        return programs / (math.ceil(programs / sms) * sms)

    best = max(fill(n) for n in range(1, most + 1))
    return next(n for n in range(1, most + 1) if fill(n) >= 0.95 * best)


def fp8_dot_splits(batch: int, head_groups: int, max_len: int, sms: int) -> int:
    """Splits for the fp8-dot kernel (mla_decode_fp8.py): its CTA takes a whole SM (shared memory), so about one
    per SM, each with at least 8 tiles of 64 rows (4 per warpgroup); at most 32. More, in waves, were slower at every
    shape timed on an H200: 54.6 us at (B, L) = (64, 4,096) with 2 splits, 63.9-77.7 us with 3, 4 or 8: waves do
    not make up for the SMs' unequal bandwidth."""
    most = max(1, min(math.ceil(max_len / (8 * 64)), 32))
    return max(1, min(most, round(sms / max(batch * head_groups, 1))))


def fp8_dots_pay(batch: int, head_groups: int, max_len: int, splits: int) -> bool:
    """Whether the fp8-dot kernel beats the widening one for a call (the default of `fp8_dots`): when each CTA gets 16
    tiles of 64 rows or more, or 4 or more and the call has 512 tiles in all. On an H200 it won at 4 to 32 tiles
    per CTA on grids of 128 CTAs (0.64x-0.97x the bf16 kernel against the widening kernel's 0.99x-1.03x), narrowly
    at 8 tiles on 64 CTAs (512 tiles: 1.00x-1.03x against 1.04x-1.07x), and at 16 and 32 tiles on the 32 CTAs of
    batch 1; it lost at 8 tiles on 16 and 32 CTAs (1.07x-1.11x against 0.89x-0.90x) and at 4 tiles on 64 (0.93x
    against 0.85x). Timed again once the kernel wrote one partial per CTA, the rule picked the faster kernel at 26
    of 27 shapes, all but batch 1 over 16,384 (1.01x against 1.10x). The rule sees max_len, not the lengths: a
    graph sized for a longer context than the batch has picks by the graph's size."""
    tiles = math.ceil(max_len / 64)
    per_cta = math.ceil(tiles / splits)
    return per_cta >= 16 or (per_cta >= 4 and batch * head_groups * tiles >= 512)


@functools.cache
def _gluon_runs_on(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on this device: Hopper's wgmma (sm_90), and a Triton whose Gluon has what
    they use (Gluon is experimental; an install without it keeps the Triton kernel)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from mlaserve.attention.triton import mla_decode_wgmma8  # noqa: F401  (imports the 16-bit kernel's module)
    except (ImportError, AttributeError):
        return False
    return True


def _pow2_from_16(n: int) -> bool:
    """A width the Gluon kernels' layouts take: a power of two, at least one wgmma K step (16)."""
    return n >= 16 and n & (n - 1) == 0


def _wgmma_fits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_h: int,
    block_n: int,
    num_warps: int,
    d_lat: int,
    d_rope: int,
) -> bool:
    """Whether the Gluon split kernel (mla_decode_wgmma.py) can run this call: Hopper's wgmma, its fixed tile."""
    return (
        _gluon_runs_on(q.device)
        and q.dtype in (torch.bfloat16, torch.float16)
        and kv_cache.dtype == q.dtype
        and (block_h, block_n, num_warps) == (64, 64, 8)
        and kv_cache.shape[1] % 64 == 0
        and _pow2_from_16(d_lat) and d_lat <= 512 and _pow2_from_16(d_rope)
    )  # fmt: skip


def _tma_rows(kv_cache: torch.Tensor) -> bool:
    """Whether TMA can copy the cache's rows: 16-byte aligned start and row stride, unit stride within a row."""
    row = kv_cache.view(-1, kv_cache.shape[-1])
    return row.stride(1) == 1 and row.stride(0) * row.element_size() % 16 == 0 and row.data_ptr() % 16 == 0


def _wgmma8_fits(q: torch.Tensor, kv_cache: torch.Tensor, block_h: int, d_lat: int, d_rope: int) -> bool:
    """Whether the Gluon 8-bit split kernel (mla_decode_wgmma8.py) can run this call."""
    return (
        _gluon_runs_on(q.device)
        and q.dtype in (torch.bfloat16, torch.float16)
        and is_quantized(kv_cache.dtype)
        and block_h == 16
        and kv_cache.shape[1] % 64 == 0
        and d_lat == 512 and _pow2_from_16(d_rope)
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How mla_decode runs one call: the tile, the grid's split count, and which split-step kernel (`kernel`:
    "gluon_fp8" mla_decode_fp8.py, "gluon_wgmma8" mla_decode_wgmma8.py, "gluon_wgmma" mla_decode_wgmma.py, or
    "triton", this file's _stage1)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    page_ahead: bool
    q_f16: bool
    kernel: str


def decode_plan(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    d_rope: int,
    block_h: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    q_f16: bool | None = None,
    page_ahead: bool | None = None,
    wgmma: bool | None = None,
    fp8_dots: bool | None = None,
) -> DecodePlan:
    """mla_decode's options with their defaults filled in for this call (q: [B, H, >= kv_lora_rank]); raises
    ValueError where wgmma=True or fp8_dots=True cannot run. The options are documented on mla_decode."""
    batch, heads = q.shape[:2]
    if block_h is None:
        block_h = 16 if heads <= 16 else 32 if heads < 64 else 64
    quantized = is_quantized(kv_cache.dtype)
    # 8-bit tiles are widened in registers; at 16 heads per program that conversion, not HBM, bounds the
    # kernel, and smaller tiles with fewer warps and fp16 dots (a cheaper widening) were fastest: fp8 at (B, L)
    # = (64, 4,096) took 0.140 ms against 0.181 ms with the bf16-cache defaults in a sweep on an H200
    # (benchmarks/diagnose/decode_sweep.py). The 64-head kernel keeps the measured defaults of bf16 caches.
    light = quantized and block_h <= 16
    tile_given = block_n is not None or num_warps is not None
    q_f16 = light and q.dtype != torch.float32 if q_f16 is None else q_f16  # fp32 models keep fp32 dots
    if num_stages is None:
        num_stages = 3 if block_h <= 16 else 2
    page = kv_cache.shape[1]
    head_groups = triton.cdiv(heads, block_h)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    if page_ahead is None:
        page_ahead = block_h <= 16 and not quantized
    if light:
        block_n, num_warps = block_n or 32, num_warps or 4
    elif block_h <= 16 and page_ahead and page % 32 == 0:
        # 16-bit tiles, two buffers each (page ahead). On an H200 (graph replays), 32-row tiles with 4 warps fit
        # two programs per SM and were fastest once the grid fills the GPU: (B, L) = (64, 4,096) 0.093 ms against
        # 0.097 for the 64-row single-buffered default, (128, 8,192) 0.308 against 0.321, batch 32 at 512 / 2,048
        # even. A grid under one program per SM (batch 1)
        # wants 64-row tiles and 8 warps: 0.023 ms against 0.025 (32 rows) and 0.028 (old default) at 16,384.
        # Pages under 32 rows keep the old defaults: their tiles span pages, so there is no page to look up ahead.
        wide = num_splits or num_splits_for(batch, head_groups, max_seq_len, 64, sms, block_h)
        small = batch * head_groups * wide < sms and page % 64 == 0
        block_n, num_warps = block_n or (64 if small else 32), num_warps or (8 if small else 4)
    else:
        block_n, num_warps = block_n or 64, num_warps or 8
    splits_given = num_splits
    if num_splits is None:
        num_splits = num_splits_for(batch, head_groups, max_seq_len, block_n, sms, block_h)
    can_wgmma = _wgmma_fits(q, kv_cache, block_h, block_n, num_warps, kv_lora_rank, d_rope)
    can_wgmma8 = _wgmma8_fits(q, kv_cache, block_h, kv_lora_rank, d_rope)
    if wgmma and not (can_wgmma or can_wgmma8):
        raise ValueError("wgmma=True needs an sm_90 GPU, a bf16/fp16 query and pages a multiple of 64 rows; with a "
                         "16-bit cache in q's dtype, 64 heads per program in 64-row tiles with 8 warps; with an "
                         "8-bit cache, 16 heads per program and a 512-wide latent")  # fmt: skip
    # By default the Gluon 8-bit kernels take fp8 caches only; int8 gained 0-5% from the widening one (and lost 1%
    # at small batches), so it stays on the Triton kernel unless asked.
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    wgmma8 = can_wgmma8 and (wgmma if wgmma is not None else (fp8 and not tile_given) or bool(fp8_dots))
    # fp8 wgmma's K step; TMA copies the rows, which wants 16-byte aligned rows
    can_fp8_dots = wgmma8 and fp8 and d_rope >= 32 and _tma_rows(kv_cache)
    if fp8_dots and not can_fp8_dots:
        raise ValueError("fp8_dots=True needs the Gluon 8-bit path: an sm_90 GPU, a bf16/fp16 query, an fp8_e4m3 "
                         "cache, 16 heads per program, a 512-wide latent, pages a multiple of 64 rows, rows TMA can "
                         "copy (16-byte aligned) and wgmma not False")  # fmt: skip
    fp8_splits = splits_given or fp8_dot_splits(batch, head_groups, max_seq_len, sms)
    pays = fp8_dots_pay(batch, head_groups, max_seq_len, fp8_splits)
    if can_fp8_dots and (fp8_dots or (fp8_dots is None and pays)):
        kernel = "gluon_fp8"
        num_splits = fp8_splits
    elif wgmma8:
        kernel = "gluon_wgmma8"
    elif can_wgmma and wgmma is not False:
        kernel = "gluon_wgmma"
    else:
        kernel = "triton"
    return DecodePlan(block_h, block_n, num_warps, num_stages, num_splits, page_ahead, q_f16, kernel)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
    block_h: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool | None = None,
    partial_dtype: torch.dtype = torch.float32,
    q_f16: bool | None = None,
    q_pe: torch.Tensor | None = None,
    page_ahead: bool | None = None,
    wgmma: bool | None = None,
    widen_bits: bool | None = None,
    fp8_dots: bool | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H, kv_lora_rank + rope], or [B, H, kv_lora_rank] with the rope part in q_pe [B, H, rope] (views
    of other tensors are fine, only the last dimension must be contiguous); kv_cache: [blocks, page, 1,
    kv_lora_rank + rope]; block_table [B, max_blocks]; seq_lens [B]. Returns (out [B, H, kv_lora_rank] in q's
    dtype, lse [B, H] float32, natural log).

    prefetch: load the next KV tile into registers before attending to the current one (default: on for 8-bit
    caches, whose tiles are converted in registers; bf16 tiles are streamed by Triton's own pipeliner).
    partial_dtype: how the per-split partial outputs are stored for the merge (their traffic is ~10% of the
    cache's at 8 splits of a 4,096 context; bf16 was no faster in the sweep, so float32 stays the default).
    q_f16: 8-bit caches only, run the dots in fp16 instead of bf16 (default: on at 16 heads per program when q is
    16-bit). page_ahead: look the next tile's page up while working on this one, so Triton's pipeliner gives the
    tile two shared-memory buffers (default: on at 16 heads per program with 16-bit caches; the prefetching
    8-bit loop already loads ahead, and the 64-head kernel was 2% slower with it). block_n and num_warps default by
    cache type and grid size (see below). wgmma: run the split step of the 64-head kernel as the Gluon kernel in
    mla_decode_wgmma.py, whose warpgroups split the scores instead of both computing all of them (default: on
    where it can run: an sm_90 GPU, 16-bit cache in q's dtype, 64 heads per program, pages a multiple of 64 rows,
    no tile or warp override); and, for an 8-bit cache at 16 heads per program, the Gluon kernel in
    mla_decode_wgmma8.py (default: fp8 caches without a tile or warp override; int8 only when asked).
    fp8_dots: with an fp8 cache on that Gluon path, run both dots on fp8 tensor cores instead of widening the tile
    (mla_decode_fp8.py; default: on there where fp8_dots_pay says it is faster). The query and p each go in as two
    e4m3 terms, which keeps about bf16's precision; what remains is the fp8 tensor cores' own accumulation: on an
    H200, at four shapes, the LSE came within 1.4e-3 of the torch reference over the dequantized cache (the widening
    kernel: 2e-6) and outputs within 4.4e-3 (widening: 4.0e-3), where the cache's own fp8 rounding moved that
    reference by 3e-3 to 3e-2 in LSE. pdl: on that fp8-dot path, launch the split step and the merge with
    programmatic dependent launch, each behind the kernel before it, so they are placed and start while it runs
    (default on; at (64, 16, 4,096) 53 us against 55 us launched plainly). The other paths launch plainly: the
    merge on PDL behind the bf16 kernel was no faster at the memory-bound shapes and 1.5-3% slower at batch 32 with
    short contexts. widen_bits: 8-bit caches with fp16 dots, widen the tiles by integer operations instead of
    conversion instructions (default: on wherever it applies; exact for every byte, and on an H200 5-7% faster for
    fp8 and 11-12% for int8 at the memory-bound shapes).

    Defaults come from the H200 sweep in benchmarks/gpu_suite.py --tune: 16 heads per program when there are few
    (memory-bound: one latent read per 16 heads), 64 with many (each latent tile then feeds 64 heads' dots)."""
    if q_pe is None:
        q, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    q, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, q_pe))
    batch, heads, _ = q.shape
    plan = decode_plan(q, kv_cache, max_seq_len, kv_lora_rank, q_pe.shape[-1], block_h, block_n, num_splits,
                       num_warps, num_stages, q_f16, page_ahead, wgmma, fp8_dots)  # fmt: skip
    block_h, block_n, num_splits, num_warps = plan.block_h, plan.block_n, plan.num_splits, plan.num_warps
    quantized = is_quantized(kv_cache.dtype)
    page = kv_cache.shape[1]
    d_rope = q_pe.shape[-1]
    row = kv_cache.shape[-1]  # width, or width + a 16-byte scale tail for 8-bit rows
    mid_o = torch.empty(batch, heads, num_splits, kv_lora_rank, dtype=partial_dtype, device=q.device)
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    kv = kv_cache.view(-1, row)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tensors = (kv, block_table, seq_lens, mid_o, mid_lse)
    strides = (kv.stride(0), block_table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
               mid_lse.stride(0), mid_lse.stride(1))  # fmt: skip
    sizes = (heads, scale * LOG2E, num_splits)
    args = (q, q_pe, *tensors, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), *strides, *sizes)
    grid = (batch, triton.cdiv(heads, block_h), num_splits)
    if plan.kernel == "gluon_fp8":
        from mlaserve.attention.triton.fp8_query import split_queries
        from mlaserve.attention.triton.mla_decode_fp8 import stage1_fp8, tma_descriptors

        stage1_fp8[grid](
            *split_queries(q, q_pe, launch_dependents=pdl), kv, *tma_descriptors(kv, d_rope), *tensors[1:],
            *strides, *sizes, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=16, BLOCK_N=64, PDL=pdl,
            num_warps=4, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    elif plan.kernel == "gluon_wgmma8":
        from mlaserve.attention.triton.mla_decode_wgmma8 import stage1_wgmma8

        stage1_wgmma8[grid](
            *args, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=16, BLOCK_N=64, num_warps=4,
        )  # fmt: skip
    elif plan.kernel == "gluon_wgmma":
        from mlaserve.attention.triton.mla_decode_wgmma import stage1_wgmma

        stage1_wgmma[grid](
            *args, PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=block_n,
            num_warps=num_warps,
        )  # fmt: skip
    else:
        _stage1[grid](
            *args,
            PAGE=page, D_LAT=kv_lora_rank, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=block_n, PRECISION=precision,
            QUANTIZED=quantized, TILE_IN_PAGE=page % block_n == 0,
            PREFETCH=quantized if prefetch is None else prefetch,
            Q_F16=plan.q_f16 and quantized,
            WIDEN_BITS=(widen_bits is not False) and quantized and plan.q_f16,
            PAGE_AHEAD=plan.page_ahead and page % block_n == 0,
            num_warps=num_warps, num_stages=plan.num_stages,
        )  # fmt: skip
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    merge_pdl = pdl and plan.kernel == "gluon_fp8"
    _stage2[(batch, heads)](
        mid_o, mid_lse, out, lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        num_splits, D_LAT=kv_lora_rank, BLOCK_S=triton.next_power_of_2(num_splits), PDL=merge_pdl,
        **({"launch_pdl": True} if merge_pdl else {}),
    )  # fmt: skip
    return out, lse
