"""Fused MoE on the GPU: tokens sorted by expert, one grouped Triton GEMM per projection.

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so every
BLOCK_M tile of the sorted list belongs to one expert and a program multiplies it by that expert's weight tile.
The routing is built with tensor ops only (no host sync), so a decode step stays capturable in a CUDA graph.
`experts_reference` in moe.py is the plain per-expert loop this is tested against.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.kernels.fit import GemmTile, first_that_builds, gemm_tiles, shared_memory_limit
from mlaserve.kernels.pdl import pdl_enter, pdl_launch
from mlaserve.layers.activation import gated_act


# The pair count changes every step; specializing on it (1, multiples of 16) would compile mid-serving.
@triton.jit(do_not_specialize=["num_valid"])
def _grouped_gemm(
    A, W, C, SortedIds, TileExpert, RouteW,
    num_valid, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    ROW_DIV: tl.constexpr, MUL_ROUTE: tl.constexpr, GATED: tl.constexpr, PAIR_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)  # before the early return: every program waits (pdl.py)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(TileExpert + pid_m).to(tl.int64)  # int64: expert * stride passes 2**31 for big models
    if expert < 0:  # a tile past the padded end of the sorted list
        return
    m = tl.arange(0, BLOCK_M)
    if PAIR_TILES:  # tile i is pair i alone (row 0); TileExpert is the routing itself, no sort was needed
        ids = tl.zeros([BLOCK_M], tl.int64) + pid_m
        ok = m == 0
    else:
        ids = tl.load(SortedIds + pid_m * BLOCK_M + m)
        ok = ids < num_valid
    rows = ids // ROW_DIV  # stage 1 reads the token's hidden state, stage 2 the pair's own row
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = W + expert * stride_we + n[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(A + rows[:, None] * stride_am + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        w = tl.load(w_rows + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows: both halves of one output column in a program
            up = tl.load(w_rows + N * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += tl.dot(a, up, input_precision=PRECISION)
    if GATED:  # SiLU(gate) * up in the epilogue: the [pairs, 2I] gate_up tensor is never written
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTE:
        acc *= tl.load(RouteW + ids, mask=ok, other=0.0)[:, None]
    tl.store(
        C + ids[:, None] * stride_cm + n[None, :],
        acc.to(C.dtype.element_ty),
        mask=ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_tiles"])
def _sort_by_expert_kernel(
    Ids, SortedIds, TileExpert, num_pairs, num_experts, capacity, num_tiles,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, LOG_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    # One program does the whole routing table (a decode step has at most a few thousand pairs): what the torch
    # version spends ~15 kernel launches on is one launch here, which matters inside a captured decode step.
    i = tl.arange(0, BLOCK_P)
    valid = i < num_pairs
    expert = tl.load(Ids + i, mask=valid, other=num_experts).to(tl.int32)  # padding sorts after every expert
    # Sorting expert * BLOCK_P + pair keeps pairs of one expert in pair order, as the stable argsort does.
    key = tl.sort(expert * BLOCK_P + i)
    sorted_expert = key // BLOCK_P
    sorted_pair = key % BLOCK_P
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(expert, BLOCK_E).to(tl.int32)  # the padding's bin (num_experts) is never read below
    counts = tl.where(e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    first = tl.cumsum(counts, 0) - counts  # where each expert's pairs start in the sorted order
    safe_expert = tl.minimum(sorted_expert, BLOCK_E - 1)
    rank = i - tl.gather(first, safe_expert, 0)
    dest = tl.gather(padded_end - padded, safe_expert, 0) + rank
    # Chunks of 1,024 keep the register footprint flat whatever the capacity (256 experts x 63 rows of padding).
    for c0 in range(0, capacity, 1024):
        c = c0 + tl.arange(0, 1024)
        tl.store(SortedIds + c, tl.full([1024], 0, tl.int64) + num_pairs, mask=c < capacity)
    tl.debug_barrier()  # the sentinel fill must land before the scatter overwrites part of it
    tl.store(SortedIds + dest, sorted_pair.to(tl.int64), mask=valid)
    _store_tile_experts(TileExpert, padded_end, num_experts, num_tiles, 0, 1, BLOCK_E, BLOCK_M, LOG_E)


@triton.jit
def _store_tile_experts(
    TileExpert, padded_end, num_experts, num_tiles, first, programs,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, LOG_E: tl.constexpr,
):  # fmt: skip
    """Every tile's expert (-1 past the last run), for the blocks of 1,024 tiles first, first + programs, ...

    A tile's expert is how many experts' padded runs end at or before its first slot: a binary search of the
    (non-decreasing) run ends, LOG_E gathers per tile instead of a tiles x experts comparison."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.where(e < num_experts, padded_end, 2147483647)
    for t0 in range(first * 1024, num_tiles, programs * 1024):
        t = t0 + tl.arange(0, 1024)
        lo = tl.zeros([1024], tl.int32)  # experts [0, lo) have ended at the tile's slot
        hi = tl.zeros([1024], tl.int32) + BLOCK_E
        for _ in tl.static_range(LOG_E):
            active = lo < hi
            mid = (lo + hi) // 2
            ended = tl.gather(ends, tl.minimum(mid, BLOCK_E - 1), 0) <= t * BLOCK_M
            lo, hi = tl.where(active & ended, mid + 1, lo), tl.where(active & ~ended, mid, hi)
        tl.store(TileExpert + t, tl.where(lo < num_experts, lo, -1).to(tl.int32), mask=t < num_tiles)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_counts_kernel(Ids, Counts, num_pairs, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """Counts[c, e]: how many of chunk c's pairs go to expert e (the padding's bin, num_experts, is never read)."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(Ids + i, mask=i < num_pairs, other=num_experts).to(tl.int32)
    tl.store(Counts + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(expert, BLOCK_E).to(tl.int32))


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_tiles", "num_chunks"])
def _chunk_scatter_kernel(
    Ids, Counts, SortedIds, TileExpert, num_pairs, num_experts, capacity, num_tiles, num_chunks,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, LOG_E: tl.constexpr, ROWS: tl.constexpr,
    PAD_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program c places chunk c's pairs: each expert's run starts where the padded runs before it end, and a pair
    lands after the same expert's pairs of earlier chunks and of its own chunk before it (the stable order). The
    programs also share the sentinel padding and the tile experts between them."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # this expert's pairs in chunks before c
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        rows = tl.load(Counts + r[:, None] * BLOCK_E + e[None, :], mask=(r < num_chunks)[:, None], other=0)
        total += tl.sum(rows, 0)
        before += tl.sum(tl.where((r < c)[:, None], rows, 0), 0)
    total = tl.where(e < num_experts, total, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    start = padded_end - padded

    i = c * CHUNK + tl.arange(0, CHUNK)
    valid = i < num_pairs
    expert = tl.load(Ids + i, mask=valid, other=num_experts).to(tl.int32)
    onehot = (expert[:, None] == e[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # earlier pairs of the same expert in this chunk
    dest = tl.gather(start + before, tl.minimum(expert, BLOCK_E - 1), 0) + rank
    tl.store(SortedIds + dest, i.to(tl.int64), mask=valid)

    # The sentinel where a run's pairs end before its padded end (PAD_E experts a step), and after the last run:
    # disjoint from every pair's slot, so no program waits for another.
    j = tl.arange(0, BLOCK_M)
    for e0 in range(c * PAD_E, BLOCK_E, num_chunks * PAD_E):
        ee = e0 + tl.arange(0, PAD_E)
        first = tl.gather(start + total, ee, 0)
        count = tl.gather(padded - total, ee, 0)
        mask = (j[None, :] < count[:, None]) & (ee < num_experts)[:, None]
        tl.store(
            SortedIds + first[:, None] + j[None, :],
            tl.full([PAD_E, BLOCK_M], 0, tl.int64) + num_pairs,
            mask=mask,
        )
    for s0 in range(tl.sum(padded, 0) + c * 1024, capacity, num_chunks * 1024):
        s = s0 + tl.arange(0, 1024)
        tl.store(SortedIds + s, tl.full([1024], 0, tl.int64) + num_pairs, mask=s < capacity)
    _store_tile_experts(
        TileExpert, padded_end, num_experts, num_tiles, c, num_chunks, BLOCK_E, BLOCK_M, LOG_E
    )


# The one program sorts in registers: decode-sized batches. Past ONE_PROGRAM_MAX_PAIRS its bitonic sort is slow
# (90 us per MoE layer at a 512-token prompt's 4,096 pairs on an H200, a sixth of the layer), and two launches over
# chunks of pairs take over: per-chunk expert counts, then each chunk's pairs scattered to their places (a
# counting sort, stable as the argsort): 12 us at those 4,096 pairs (32 chunks). Every scatter program reads all
# chunks' counts, so the cost grows with the square of the chunks: at 512 chunks (65,536 pairs) it took 133 us,
# no faster than torch's sort, which takes over past MAX_CHUNKS. All are checked against each other on the GPU
# (tests/gpu/test_fused_moe_on_gpu.py) and on CPU (tests/layers/test_fused_moe.py).
ONE_PROGRAM_MAX_PAIRS = 1024
MAX_CHUNKS = 128


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert to block_m with the sentinel T*k, the expert of every tile or -1).

    One Triton launch for decode-sized batches, two (the chunked counting sort) up to MAX_CHUNKS chunks of pairs,
    the torch version (sort_by_expert_reference) past that."""
    num_pairs = ids.numel()
    block_e = triton.next_power_of_2(num_experts + 1)
    chunk = max(16, 16384 // block_e)  # the scatter's [chunk, experts] one-hot stays in registers
    chunks = triton.cdiv(num_pairs, chunk)
    if num_pairs == 0 or chunks > MAX_CHUNKS:
        return sort_by_expert_reference(ids, num_experts, block_m)
    capacity = _capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(capacity, dtype=torch.int64, device=ids.device)
    tile_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    if num_pairs > ONE_PROGRAM_MAX_PAIRS:
        flat = ids.flatten()
        counts = torch.empty(chunks, block_e, dtype=torch.int32, device=ids.device)
        _chunk_counts_kernel[(chunks,)](
            flat, counts, num_pairs, num_experts, CHUNK=chunk, BLOCK_E=block_e, **pdl_launch(ids)
        )
        _chunk_scatter_kernel[(chunks,)](
            flat, counts, sorted_ids, tile_expert, num_pairs, num_experts, capacity, capacity // block_m, chunks,
            CHUNK=chunk, BLOCK_E=block_e, BLOCK_M=block_m, LOG_E=block_e.bit_length(),
            ROWS=max(1, 8192 // block_e), PAD_E=min(block_e, 8192 // block_m), num_warps=8, **pdl_launch(ids),
        )  # fmt: skip
        return sorted_ids, tile_expert
    _sort_by_expert_kernel[(1,)](
        ids.flatten(), sorted_ids, tile_expert, num_pairs, num_experts, capacity, capacity // block_m,
        BLOCK_P=triton.next_power_of_2(num_pairs), BLOCK_E=block_e, BLOCK_M=block_m,
        LOG_E=block_e.bit_length(), num_warps=4 if num_pairs <= 1024 else 8, **pdl_launch(ids),
    )  # fmt: skip
    return sorted_ids, tile_expert


def _capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    capacity = num_pairs + num_experts * (block_m - 1)  # the worst case, so no host sync sizes the buffers
    return (capacity + block_m - 1) // block_m * block_m


def sort_by_expert_reference(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch definition of sort_by_expert (any size; about 15 kernel launches)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    # scatter_add, not bincount: CUDA bincount reads the max back to the host, which breaks graph capture.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[flat[order]]
    capacity = _capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int64, device=ids.device)
    sorted_ids[(padded_end - padded)[flat[order]] + rank] = order
    tile_start = torch.arange(0, capacity, block_m, device=ids.device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor | None,
    tile_expert: torch.Tensor,
    num_pairs: int,
    row_div: int,
    route_weights: torch.Tensor | None,
    block_m: int,
    gated: bool = False,
    tiles: tuple[GemmTile, ...] | None = None,
) -> torch.Tensor:
    """out[pair] = a[pair // row_div] @ w[expert(pair)].T (times the pair's routing weight).

    gated: w holds gate rows then up rows and out[pair] = silu(gate) * up, half of w's rows wide.
    sorted_ids None: pair tiles, one pair per tile and tile_expert the flat routing (see tile_plan).
    tiles: the ladder to launch from (sweeps, tests); default tile_ladder's for the dtype and device."""
    n, k = w.shape[1] // (2 if gated else 1), w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if tiles is None:
        tiles = tile_ladder(block_m, n, k, a.element_size(), gated, shared_memory_limit(a.device))

    def launch(tile: GemmTile) -> None:
        _grouped_gemm[(tile_expert.numel(), triton.cdiv(n, tile.block_n))](
            a, w, out, tile_expert if sorted_ids is None else sorted_ids, tile_expert,
            route_weights if route_weights is not None else out,
            num_pairs, n, k,
            a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
            ROW_DIV=row_div, MUL_ROUTE=route_weights is not None, GATED=gated, PAIR_TILES=sorted_ids is None,
            BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=tile.warps,
            num_stages=tile.stages, **pdl_launch(a),
        )  # fmt: skip

    first_that_builds("grouped_gemm", tiles, launch)
    return out


def tile_config(block_m: int, k: int) -> GemmTile:
    """The tuned tile, from a sweep on an H200 at V2-Lite's w13 shape in bf16
    (benchmarks/diagnose/grouped_gemm_sweep.py): decode-sized 16-row tiles stream weights best with long K steps
    (1 token: 29.7 us vs 35.6 us for 64x64 tiles), 64-row tiles with wide N (4,096 tokens: 0.78 ms vs 0.94 ms)."""
    if block_m >= 128:
        block_n, block_k, warps, stages = 128, 64, 8, 3
    elif block_m >= 64:
        block_n, block_k, warps, stages = 128, 64, 4, 3
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    return GemmTile(block_n, min(block_k, triton.next_power_of_2(max(k, 16))), warps, stages)


@functools.lru_cache(maxsize=1024)
def tile_ladder(
    block_m: int, n: int, k: int, elem_bytes: int, gated: bool, limit: int
) -> tuple[GemmTile, ...]:
    """The tuned tile (no wider than the output), then smaller ones, from the first whose shared memory (A, and
    the weight tile or the gate and up tiles, per stage) fits `limit` for this element size: the tiles were tuned
    for bf16, and float32 doubles every buffer, past what an H200 gives a program at 64 rows and more."""
    tuned = tile_config(block_m, k)
    tuned = tuned._replace(block_n=min(tuned.block_n, max(16, triton.next_power_of_2(n))))
    return gemm_tiles(tuned, block_m, elem_bytes, 2 if gated else 1, limit)


def tile_plan(num_pairs: int, num_experts: int) -> tuple[int, bool]:
    """(rows per tile, pair tiles?) for a batch of (token, expert) pairs.

    A handful of pairs spread over many experts (small decode batches) rarely share an expert, so each pair gets
    its own tile and no sort runs at all. Tensor-core tiles are 64 rows tall, so 16-row tiles waste most of each
    multiply once experts get more than a few rows; 128-row tiles once they average 128 (long prefills). Between
    16 and 32 rows per expert, 32-row tiles: at V2-Lite's shape on an H200, 229 tokens (21 rows per expert) took
    0.293 ms against 0.307 ms in 64-row tiles and 0.344 ms in 16-row ones, while 106 tokens (10 per expert) were
    fastest in 16-row tiles (results/h200-diagnose-2026-12-02-moe-mixed.json); from 32 per expert 64-row tiles, as
    before (32-row ones not timed there)."""
    if num_pairs * 4 <= num_experts:
        return 16, True
    if num_pairs >= 128 * num_experts:
        return 128, False
    if num_pairs >= 32 * num_experts:
        return 64, False
    return (32 if num_pairs >= 16 * num_experts else 16), False


@triton.jit
def _combine_kernel(
    Down, Add, Out, Pos, RouteW, hidden,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        if GATHER:  # the pair's row sits where the expert sort put it; its routing weight is applied here
            row = tl.load(Pos + t * TOP_K + j).to(tl.int64)
            down = tl.load(Down + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
            acc += down * tl.load(RouteW + t * TOP_K + j)
        else:
            acc += tl.load(Down + (t * TOP_K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(Add + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * hidden + cols, acc.to(Out.dtype.element_ty), mask=ok)


def combine(
    down: torch.Tensor,
    top_k: int,
    add: torch.Tensor | None,
    pos: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum of down[t * top_k + j] over j (+ add[t]), summed in float32 and rounded once.

    With pos (and route_weights): down is in sorted order and pair p's row is down[pos[p]], weighed by
    route_weights[p] (float32) before the sum.

    One launch: torch's sum over the middle axis of [T, k, hidden] took 5 us at one token on an H200, and the
    shared experts' add was another kernel."""
    num_tokens, hidden = down.shape[0] // top_k, down.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=down.dtype, device=down.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        down,
        add if add is not None else down,
        out,
        pos if pos is not None else down,
        route_weights if route_weights is not None else down,
        hidden,
        TOP_K=top_k,
        HAS_ADD=add is not None,
        GATHER=pos is not None,
        BLOCK=block,
        **pdl_launch(down),
    )
    return out


def _act_and_mul(gate_up: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up for an activation no kernel fuses (gate columns, then up), contiguous for the next GEMM."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (act(gate) * up).contiguous()


# From this many (token, expert) pairs per expert, torch's grouped GEMM (CUTLASS, TMA and warp-specialized on
# sm_90) replaces the Triton one for long prompts; see grouped_mm_experts. At V2-Lite's engine shape (66 experts
# with the shared two, top 8) on an H200 the two were even at 2,048 tokens (248 pairs per expert: 0.77 ms against
# 0.79), torch's 12-18% faster from 4,096 tokens (2.30 against 2.65 ms at 8,192) and up to 1.5x slower below
# 1,024 (results/h200-diagnose-2026-12-03-moe-grouped-mm.json).
GROUPED_MM_PAIRS_PER_EXPERT = 256


def grouped_mm_usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> bool:
    """Whether grouped_mm_experts can take this call: bf16, widths in whole 16-byte rows (CUTLASS's alignment),
    enough pairs per expert, and torch's grouped GEMM kernel on this GPU (sm_90 and newer CUDA)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16:
        return False
    if num_pairs < GROUPED_MM_PAIRS_PER_EXPERT * w13.shape[0] or any(
        d % 8 for d in (*w13.shape[1:], w2.shape[2])
    ):
        return False
    return not x.is_cuda or (torch.version.hip is None and torch.cuda.get_device_capability(x.device)[0] >= 9)


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_experts for long prompts through torch._grouped_mm: pairs sorted by expert (no padding), their tokens
    gathered into one contiguous [pairs, hidden] block, one grouped GEMM per projection over the experts' row
    ranges, and the combine reading each pair's row back through the sort. No host sync (offsets stay on the
    device). Same contract as fused_experts, bf16 only (grouped_mm_usable)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    gate_up = torch._grouped_mm(x.index_select(0, order // top_k), w13.transpose(1, 2), offs=offs)
    hidden = gated_act(gate_up, "silu") if act is F.silu else _act_and_mul(gate_up, act)
    down = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)
    return combine(down, top_k, add, pos, weights.flatten().float().contiguous())


def fused_experts(
    x, w13, w2, weights, ids, act, block_m: int | None = None, add: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as moe.experts_reference: x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I]; plus
    `add` ([T, hidden], e.g. the shared experts' output) added to the result in the same kernel.

    block_m forces sorted tiles of that height (tests, sweeps); None lets tile_plan choose, or hands long prompts
    to grouped_mm_experts."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    pair_tiles = False
    if block_m is None and grouped_mm_usable(x, w13, w2, num_pairs):
        return grouped_mm_experts(x, w13, w2, weights, ids, act, add)
    if block_m is None:
        block_m, pair_tiles = tile_plan(num_pairs, w13.shape[0])
    if pair_tiles:
        sorted_ids, tile_expert = None, ids.flatten()
    else:
        sorted_ids, tile_expert = sort_by_expert(ids, w13.shape[0], block_m)
    if act is F.silu:
        hidden = grouped_gemm(x, w13, sorted_ids, tile_expert, num_pairs, top_k, None, block_m, gated=True)
    else:
        hidden = _act_and_mul(
            grouped_gemm(x, w13, sorted_ids, tile_expert, num_pairs, top_k, None, block_m), act
        )
    route = weights.flatten().float().contiguous()
    down = grouped_gemm(hidden, w2, sorted_ids, tile_expert, num_pairs, 1, route, block_m)
    return combine(down, top_k, add)
