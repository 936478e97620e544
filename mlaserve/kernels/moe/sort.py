"""Tokens' (token, expert) pairs sorted by expert for the tiled expert GEMMs, on the GPU without a host sync.

Each expert's run of pairs is padded to a multiple of BLOCK_M with a sentinel, so every BLOCK_M tile of the sorted
list belongs to one expert; `sort_by_expert` returns the sorted pair ids and each tile's expert. The routing is
built with tensor ops only, so a decode step stays capturable in a CUDA graph. `sort_by_expert_reference` is the
torch definition it is tested against, and the path past MAX_CHUNKS.
"""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch


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


# The one program sorts in registers: decode-sized batches. Past ONE_PROGRAM_MAX_PAIRS its bitonic sort is slow,
# and two launches over chunks of pairs take over: per-chunk expert counts, then each chunk's pairs scattered to
# their places (a counting sort, stable as the argsort). Every scatter program reads all chunks' counts, so the cost
# grows with the square of the chunks, and past MAX_CHUNKS torch's sort is no slower. All are checked against each
# other on the GPU (tests/gpu/test_fused_moe_on_gpu.py) and on CPU (tests/kernels/test_moe.py).
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
