"""DeepSeek-V3.2's index scores on the GPU, then the top-k: the lightning indexer's selection for a step.

Every query token is scored against the paged indexer keys it may see (its sequence's block table, up to its own
position): one program takes one token and a span of TILES tiles of BLOCK_N keys, loads the token's index_n_heads
queries once, and sums weights[h] * relu(scale * q[h] . key) over the heads with one tensor-core dot per tile. Keys past a
token's visible length score -inf, so top-k never picks them and the caller turns them into -1. 8-bit key caches
(values, then the row's float32 scale: kvcache/quant.py) are widened in registers and the scale applied per key.

torch.topk then picks each token's k best (a radix select on CUDA; unsorted), and one kernel turns their positions
into flat cache slots through the block table, the valid ones first and -1 after them. attention/sparse.py's select_topk is the reference this is tested against.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels import fit
from mlaserve.kvcache.quant import is_quantized

_MAX_SCORES = 1 << 27  # float32 scores held at once (512 MiB): long prefills are scored in slices of tokens


@triton.jit
def _index_scores(
    Q, W, Keys, BlockTable, TableRow, Visible, Out,
    stride_qt, stride_qh, stride_wt, stride_k, stride_bt, stride_ot, length, scale,
    HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, STAGES: tl.constexpr, QUANTIZED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    span = tl.program_id(1) * BLOCK_N * TILES
    visible = tl.load(Visible + t)
    if span >= visible:  # a span wholly past this token's keys (causal prefill): nothing to load
        for i in range(TILES):
            pos = span + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(
                Out + t * stride_ot + pos, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=pos < length
            )
        return
    # The token's queries and head weights, loaded once for the span's TILES tiles: one load per key tile made the
    # queries' reads (from L2) as large as the keys' (from HBM).
    dims = tl.arange(0, D)
    heads = tl.arange(0, BLOCK_H)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=(heads < HEADS)[:, None],
                other=0.0)  # fmt: skip
    w = tl.load(W + t * stride_wt + heads, mask=heads < HEADS, other=0.0)
    row = tl.load(TableRow + t).to(tl.int64)
    for i in tl.range(TILES, num_stages=STAGES):
        pos = span + i * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = pos < visible
        page = tl.load(BlockTable + row * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        base = Keys + (page * PAGE + pos % PAGE) * stride_k
        k = tl.load(base[:, None] + dims[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, D]
        if QUANTIZED:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        if QUANTIZED:
            key_scale = tl.load((base + D).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
            s = s * key_scale[None, :]
        score = tl.sum(tl.maximum(s * scale, 0.0) * w[:, None], axis=0)
        tl.store(Out + t * stride_ot + pos, tl.where(ok, score, float("-inf")), mask=pos < length)


def index_scores_paged(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_rows: torch.Tensor,
    visible: torch.Tensor,
    length: int,
    scale: float,
    block_n: int = 64,
    tiles: int = 16,
    num_warps: int = 4,
    stages: int = 2,
) -> torch.Tensor:
    """Scores [T, length] float32 of each token's visible keys (-inf past them). q [T, H, D] (16- or 32-bit),
    weights [T, H] float32, key_cache [blocks, page, 1, D (+ 16 for 8-bit rows)], block_tables [S, max_blocks],
    table_rows [T] (each token's row of block_tables), visible [T] (keys it may see, from position 0). A program
    scores tiles * block_n keys of one token, its loop pipelined over `stages` tiles (benchmarks/gpu_sparse.py
    sweeps these)."""
    num_tokens, heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(
            f"the Triton index-score kernel takes index_head_dim a power of two >= 16, got {dim}"
        )
    out = torch.empty(num_tokens, length, dtype=torch.float32, device=q.device)
    keys = key_cache.view(-1, key_cache.shape[-1])
    if not (num_tokens and length):
        return out
    block_h = max(16, triton.next_power_of_2(heads))
    first = ScoreTile(block_n, tiles, num_warps, stages)
    rungs = score_tiles(first, block_h, dim, q.element_size(), fit.shared_memory_limit(q.device))

    def launch(tile: ScoreTile) -> None:
        _index_scores[(num_tokens, triton.cdiv(length, tile.block_n * tile.tiles))](
            q, weights, keys, block_tables, table_rows, visible, out,
            q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), block_tables.stride(0), out.stride(0),
            length, scale, HEADS=heads, D=dim, PAGE=key_cache.shape[1], BLOCK_H=block_h,
            BLOCK_N=tile.block_n, TILES=tile.tiles, STAGES=tile.stages, QUANTIZED=is_quantized(key_cache.dtype),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tile.warps,
        )  # fmt: skip

    fit.first_that_builds("index_scores", rungs, launch)
    return out


class ScoreTile(NamedTuple):
    """The index-score kernel's tile: keys per dot, tiles per program, warps, pipeline stages."""

    block_n: int
    tiles: int
    warps: int
    stages: int


def _smaller_score_tile(tile: ScoreTile) -> ScoreTile | None:
    """One key buffer, then narrower key tiles (a program keeps its span by taking more of them)."""
    if tile.stages > 1:
        return tile._replace(stages=1)
    if tile.block_n > 16:
        return tile._replace(block_n=tile.block_n // 2, tiles=tile.tiles * 2)
    return None


@functools.lru_cache(maxsize=256)
def score_tiles(
    first: ScoreTile, block_h: int, dim: int, elem_bytes: int, limit: int
) -> tuple[ScoreTile, ...]:
    """`first`, then smaller tiles, from the first whose shared memory (the queries, and a key tile per stage)
    fits `limit` for this element size."""

    def shared_bytes(tile: ScoreTile) -> int:
        return elem_bytes * dim * (block_h + max(1, tile.stages) * tile.block_n)

    return fit.fitting(fit.ladder(first, _smaller_score_tile), shared_bytes, limit)


def select_topk_paged(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_rows: torch.Tensor,
    visible: torch.Tensor,
    max_visible: int,
    topk: int,
    scale: float,
    lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's top-k visible keys as flat cache slots, [T, min(topk, max_visible)], -1 padded (the layout of
    attention/sparse.py's select_topk). Long batches are scored a slice of tokens at a time. With `lens` ([T]
    int32, written here: each token's count of slots) the slots are int32 with 0 for padding, a table the decode
    kernels read as pages of one row, without the count, clamp and cast launches that -1 padding needs."""
    k = min(topk, max_visible)
    page = key_cache.shape[1]
    # the dots take the cache's dtype; 8-bit keys widen (exactly) to the query's
    q = q if is_quantized(key_cache.dtype) else q.to(key_cache.dtype)
    weights = weights.float()
    out = torch.empty(q.shape[0], k, dtype=torch.long if lens is None else torch.int32, device=q.device)
    step = max(1, _MAX_SCORES // max(1, max_visible))
    for s in range(0, q.shape[0], step):
        rows = slice(s, s + step)
        scores = index_scores_paged(
            q[rows],
            weights[rows],
            key_cache,
            block_tables,
            table_rows[rows],
            visible[rows],
            max_visible,
            scale,
        )
        values, idx = scores.topk(k, dim=-1, sorted=False)  # in no order: faster than sorted
        counts = None if lens is None else lens[rows]
        slots_of_positions(values, idx, block_tables, table_rows[rows], page, out[rows], counts)
    return out


@triton.jit
def _slots(
    Values, Index, BlockTable, TableRow, Out, Lens, stride_v, stride_i, stride_bt, stride_o, k,
    PAGE: tl.constexpr, BLOCK: tl.constexpr, TABLE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_k = cols < k
    pos = tl.load(Index + t * stride_i + cols, mask=in_k, other=0)
    picked = (tl.load(Values + t * stride_v + cols, mask=in_k, other=float("-inf")) != float("-inf")).to(
        tl.int32
    )
    row = tl.load(TableRow + t).to(tl.int64)
    page = tl.load(BlockTable + row * stride_bt + pos // PAGE, mask=picked != 0, other=0).to(tl.int64)
    # Compaction: the picked slots first, then the padding (unsorted top-k interleaves them where keys are too few).
    dest = tl.where(picked != 0, tl.cumsum(picked, 0) - 1, tl.sum(picked, 0) + tl.cumsum(1 - picked, 0) - 1)
    if TABLE:
        slot = tl.where(picked != 0, page * PAGE + pos % PAGE, 0)
    else:
        slot = tl.where(picked != 0, page * PAGE + pos % PAGE, -1)
    tl.store(Out + t * stride_o + dest, slot.to(Out.dtype.element_ty), mask=in_k)
    if TABLE:
        tl.store(Lens + t, tl.sum(picked, 0))


def slots_of_positions(
    values: torch.Tensor,
    idx: torch.Tensor,
    block_tables: torch.Tensor,
    table_rows: torch.Tensor,
    page: int,
    out: torch.Tensor,
    lens: torch.Tensor | None = None,
) -> None:
    """out [T, k] int64 = the flat cache slots of top-k's positions idx [T, k] through each token's block-table row,
    those whose value is -inf (fewer visible keys than k) as -1 after the others. One kernel where the torch
    expression took eight. With `lens` ([T] int32), out is int32 with 0s after the picked slots and lens their
    count (select_topk_paged)."""
    if idx.numel():
        _slots[(idx.shape[0],)](
            values, idx, block_tables, table_rows, out, out if lens is None else lens, values.stride(0),
            idx.stride(0), block_tables.stride(0), out.stride(0), idx.shape[1], PAGE=page,
            BLOCK=triton.next_power_of_2(idx.shape[1]), TABLE=lens is not None,
        )  # fmt: skip
    elif lens is not None:
        lens.zero_()
