"""Varlen causal prefill attention in Triton, flash-attention style, with K and V of different head widths.

MLA's expanded prefill attends with 192-wide queries and keys (128 nope + 64 rope) and 128-wide values. Flash
attention's varlen op takes one head size, so today's path pads V to 192 columns: half as much PV work again and a
copy. Here the QK^T dot runs as two dots over the head dimension's split (tiles.head_split: 128 + 64 for DeepSeek)
and PV at the value's own width.

Each program takes BLOCK_M queries of one sequence and one head and walks that sequence's keys BLOCK_N at a time
with an online softmax in base 2 (the scale and log2(e) folded into one multiply). A sequence's queries are the
last of its keys (bottom-right causal: a chunk sees its cached prefix and the causal part of itself), so a query
tile needs no key past its last query's position: tiles above the diagonal are never visited, and only the tiles
on the diagonal (and, with a window, on the window's edge) pay for the mask. The grid is (query tiles of all
sequences, heads), with a tile -> (sequence, first query) map built on the device from cu_q (`tile_map`), so
nothing waits for the host and a captured graph replays with any lengths; heavier tiles (later in their sequence)
are listed first so the last wave is short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fit import first_that_builds, shared_memory_limit
from mlaserve.kernels.prefill_attn.tiles import DEFAULT_TILE, PrefillTile, head_split, tile_ladder

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # LOG2E inside kernels, which read only constexpr globals


@triton.jit
def _load_cols(
    base, rows_ok, COL0: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """Columns COL0 .. COL0 + WIDTH of the rows at pointers `base`, zero-padded to TILE (rows past `rows_ok` zero
    where CHECK_ROWS)."""
    cols = tl.arange(0, TILE)
    ptrs = base[:, None] + COL0 + cols[None, :]
    if WIDTH == TILE:
        if CHECK_ROWS:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        return tl.load(ptrs)
    if CHECK_ROWS:
        return tl.load(ptrs, mask=rows_ok[:, None] & (cols < WIDTH)[None, :], other=0.0)
    return tl.load(ptrs, mask=(cols < WIDTH)[None, :], other=0.0)


@triton.jit
def _attend(
    acc, m_i, l_i, q1, q2, k_base, v_base, stride_k, stride_v, q_pos, k_len, window, qk_scale, lo, hi,
    BLOCK_N: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr, FIRST_TILE: tl.constexpr,
    SECOND_TILE: tl.constexpr, DV: tl.constexpr, DV_TILE: tl.constexpr, MASKED: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax over keys lo .. hi (lo a multiple of BLOCK_N). MASKED: some keys of a step are hidden
    from some queries (the diagonal, the window's edge, the sequence's end); otherwise every query sees them all."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < k_len
        k_rows = k_base + n.to(tl.int64) * stride_k
        k1 = _load_cols(k_rows, ok, 0, FIRST, FIRST_TILE, MASKED)
        s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        if SECOND_TILE > 0:
            k2 = _load_cols(k_rows, ok, FIRST, SECOND, SECOND_TILE, MASKED)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
        s = s * qk_scale
        if MASKED:
            see = (n[None, :] <= q_pos[:, None]) & ok[None, :]
            if WINDOW:
                see = see & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row that has seen no key yet keeps -inf: exponentiate against 0 instead (all terms 0)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_cols(v_base + n.to(tl.int64) * stride_v, ok, 0, DV, DV_TILE, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Lse, TileSeq, TileStart, CuQ, CuK, qk_scale, window, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    FIRST: tl.constexpr, SECOND: tl.constexpr, FIRST_TILE: tl.constexpr, SECOND_TILE: tl.constexpr,
    DV: tl.constexpr, DV_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(TileSeq + tile)
    if b < 0:  # the grid is sized for the most tiles any lengths could need
        return
    m0 = tl.load(TileStart + tile)
    q_begin = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_begin
    k_begin = tl.load(CuK + b)
    k_len = tl.load(CuK + b + 1) - k_begin
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    # Query j sits at key position k_len - q_len + j. Rows past the sequence take its last query's position, so
    # every row sees some key and none needs a guard against an empty softmax.
    q_pos = tl.minimum(k_len - q_len + rows, k_len - 1)
    first_pos = k_len - q_len + m0
    hi = tl.minimum(first_pos + BLOCK_M, k_len)  # no query of the tile sees a key from here on

    q_rows = Q + (q_begin + rows).to(tl.int64) * stride_qt + h * stride_qh
    q1 = _load_cols(q_rows, row_ok, 0, FIRST, FIRST_TILE, True)
    if SECOND_TILE > 0:
        q2 = _load_cols(q_rows, row_ok, FIRST, SECOND, SECOND_TILE, True)
    else:
        q2 = q1  # unused: one dot covers the head
    kv_head = h // group
    k_base = K + k_begin.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_begin.to(tl.int64) * stride_vt + kv_head * stride_vh

    acc = tl.zeros([BLOCK_M, DV_TILE], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Key steps that every query of the tile sees whole: from full_lo (the window's edge for the last query) up to
    # full_hi (the first query's position); the steps before and after are masked.
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(hi - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, window, qk_scale, lo,
            mid_lo, BLOCK_N, FIRST, SECOND, FIRST_TILE, SECOND_TILE, DV, DV_TILE, True, WINDOW, PRECISION,
        )  # fmt: skip
    else:
        mid_lo = 0
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, window, qk_scale, mid_lo,
        mid_hi, BLOCK_N, FIRST, SECOND, FIRST_TILE, SECOND_TILE, DV, DV_TILE, False, WINDOW, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt, q_pos, k_len, window, qk_scale, mid_hi,
        hi, BLOCK_N, FIRST, SECOND, FIRST_TILE, SECOND_TILE, DV, DV_TILE, True, WINDOW, PRECISION,
    )  # fmt: skip

    cols = tl.arange(0, DV_TILE)
    out_rows = Out + (q_begin + rows).to(tl.int64) * stride_ot + h * stride_oh
    out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
    tl.store(out_rows[:, None] + cols[None, :], out, mask=row_ok[:, None] & (cols < DV)[None, :])
    if WRITE_LSE:  # natural log, as torch.logsumexp of the scaled scores
        lse = (m_i + tl.math.log2(l_i)) / _LOG2E
        tl.store(Lse + (q_begin + rows).to(tl.int64) * stride_lt + h, lse, mask=row_ok)


def tile_map(cu_q: torch.Tensor, num_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query row within it) of each query tile, int32, longest-running first: sum over sequences
    of ceil(len / block_m) tiles, then -1 sequences up to num_tokens // block_m + sequences (the most any lengths
    summing to num_tokens need), a fixed size so the grid does not depend on the lengths. Device ops only."""
    num_seqs = cu_q.shape[0] - 1
    count = num_tokens // block_m + num_seqs
    tiles = (cu_q[1:] - cu_q[:-1] + block_m - 1) // block_m
    ends = tiles.long().cumsum(0)
    # Later tiles of a sequence see more keys: list tiles from the last one back.
    t = ends[-1:] - 1 - torch.arange(count, device=cu_q.device)
    seq = torch.searchsorted(ends, t, right=True).clamp(max=num_seqs - 1)
    start = (t - (ends[seq] - tiles[seq])) * block_m
    valid = t >= 0
    return torch.where(valid, seq, -1).int(), torch.where(valid, start, 0).int()


def kernel_constants(
    qk_dim: int, v_dim: int, tile: PrefillTile, window: bool, write_lse: bool, float32: bool
) -> dict[str, object]:
    """The kernel's compile-time arguments for a call (the launch's, and the sm_90 build test's)."""
    split = head_split(qk_dim, v_dim)
    return dict(
        FIRST=split.first, SECOND=split.second, FIRST_TILE=split.first_tile, SECOND_TILE=split.second_tile,
        DV=v_dim, DV_TILE=split.value_tile, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, WINDOW=window,
        # float32 runs (tests, float32 models) keep float32 dots: tf32's rounding would be the largest error in them
        WRITE_LSE=write_lse, PRECISION="ieee" if float32 else None,
    )  # fmt: skip


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    tile: PrefillTile,
) -> object:
    """Launches the kernel; returns what Triton's launch returns (the compiled kernel on a GPU)."""
    tile_seq, tile_start = tile_map(cu_q, q.shape[0], tile.block_m)
    lse_arg = out if lse is None else lse  # never written without WRITE_LSE
    constants = kernel_constants(
        q.shape[-1], v.shape[-1], tile, window is not None, lse is not None, q.dtype == torch.float32
    )
    return _prefill_kernel[(tile_seq.shape[0], q.shape[1])](
        q, k, v, out, lse_arg, tile_seq, tile_start, cu_q, cu_k, scale * LOG2E, window or 0,
        q.shape[1] // k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0), **constants, num_warps=tile.warps,
        num_stages=tile.stages,
    )  # fmt: skip


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or v.dim() != 3
        or q.shape[-1] != k.shape[-1]
        or k.shape[:2] != v.shape[:2]
    ):
        raise ValueError(
            f"prefill_attention takes q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"prefill_attention takes query heads a multiple of K/V heads, not {q.shape[1]} and {k.shape[1]}"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v)) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError("prefill_attention takes q, k and v of one dtype with unit-stride last dimensions")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape:
        raise ValueError(
            "prefill_attention takes cu_q and cu_k as int32 offsets, one more than the sequences"
        )


def prefill_attention_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_lse: bool = False,
    tile: PrefillTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prefill_attention with one tile (benchmarks sweep tiles.TILE_CANDIDATES through this), or None: the
    default tile's ladder, moving down to a smaller tile where a larger one does not fit the device."""
    _check(q, k, v, cu_q, cu_k)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if return_lse else None
    if q.shape[0] == 0:
        return out, lse
    if tile is not None:
        _launch(q, k, v, cu_q, cu_k, scale, window, out, lse, tile)
        return out, lse
    split = head_split(q.shape[-1], v.shape[-1])
    rungs = tile_ladder(DEFAULT_TILE, split, q.element_size(), shared_memory_limit(q.device))
    first_that_builds(
        "prefill_attention", rungs, lambda t: _launch(q, k, v, cu_q, cu_k, scale, window, out, lse, t)
    )
    return out, lse


def tile_facts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    tile: PrefillTile,
) -> dict[str, int]:
    """Registers per thread, spilled registers and shared memory of the kernel compiled at `tile` for this call's
    dtypes and widths, after one launch: what a benchmark reads occupancy from. Empty under the interpreter."""
    _check(q, k, v, cu_q, cu_k)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    kernel = _launch(q, k, v, cu_q, cu_k, 1.0, None, out, None, tile)
    if not hasattr(kernel, "n_regs"):
        return {}
    return {"registers": kernel.n_regs, "spills": kernel.n_spills, "shared_bytes": kernel.metadata.shared}


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: int | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of every sequence's queries over its keys: q [T, H, Dqk], k [S, Hkv, Dqk], v [S, Hkv, Dv]
    (H a multiple of Hkv; 16-bit, or float32 for tests), cu_q and cu_k int32 [num_seqs + 1] offsets of each
    sequence's queries and keys, each sequence's queries the last of its keys; window W: query position p sees
    keys p - W + 1 .. p. Returns (out [T, H, Dv] in q's dtype, the natural-log LSE [T, H] float32 or None).
    reference.prefill_attention_reference is the same in torch."""
    return prefill_attention_tiled(q, k, v, cu_q, cu_k, scale, window, return_lse)
