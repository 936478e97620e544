"""The producer of the fp8-dot decode kernel (gluon_fp8.py): the ring of shared-memory slots its consumers take
tiles from, the TMA descriptors over the cache's rows, and the warpgroup that copies each tile into a free slot.

A tile is copied by TMA as three boxes counted on the slot's `ready` barrier: the latent part as one 3-D box (four
chunks of 128 columns, one copy instruction where four 2-D boxes would each bring a barrier of Triton's), the rope
part, and the rows' 16-byte tails, whose row scales the consumers read from the slot. A sequence's last, partial
tile comes by cp.async instead, which zero-fills the rows past its end: they can hold a freed page's bytes, NaN
included, and p = 0 does not cancel a NaN in the values' dot. The producer reads the block table one tile ahead of
the copy, so the lookup does not sit between a slot's release and its refill.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlaserve.kernels.mla_decode.gluon_common import CHUNK, async_load, barrier, copy_tile, tma_load, view_as
from mlaserve.kvcache.quant import TAIL_BYTES

# Tiles in the ring: two per warpgroup (one worked on, one in flight). An even count gives each slot one consumer;
# six do not fit in shared memory beside the queries.
SLOTS = gl.constexpr(4)
# A tile's latent part as TMA copies it: [LAT_CHUNKS, rows, CHUNK], chunk by chunk.
LAT_CHUNKS = gl.constexpr(4)
LAT_SMEM3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
# Each row's 16-byte tail (its float32 scale, then padding) comes with the tile, unswizzled: row r at byte 16 * r.
TAIL = gl.constexpr(TAIL_BYTES)
TAIL_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))


def tma_descriptors(
    kv: torch.Tensor, d_rope: int
) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the fp8 cache's rows kv [rows, width] (d_lat + d_rope values, then the 16-byte tail that
    starts with the row scale) for stage1_fp8: the latent part as [chunks, rows, CHUNK] (d_lat / CHUNK column
    chunks, each its own dimension) in boxes of [chunks, 64, CHUNK], and boxes of 64 rows by the rope part and by the
    tail. One box copies a tile's latent part in the layout that four [64, CHUNK] boxes give it (the 128-byte
    swizzle keeps each chunk of CHUNK columns whole, one after another), with one copy instruction and none of the
    barriers the compiler puts between copies into one buffer."""
    shape, strides = list(kv.shape), [kv.stride(0), 1]
    chunks = LAT_CHUNKS.value
    rope = gl.NVMMASharedLayout(swizzle_byte_width=min(d_rope, 128), element_bitwidth=8, rank=2)
    return (
        TensorDescriptor(
            kv,
            [chunks, shape[0], CHUNK.value],
            [CHUNK.value, strides[0], 1],
            [chunks, 64, CHUNK.value],
            LAT_SMEM3.value,
        ),
        TensorDescriptor(kv, shape, strides, [64, d_rope], rope),
        TensorDescriptor(kv, shape, strides, [64, TAIL.value], TAIL_SMEM.value),
    )


@gluon.jit
def fill(slot_k, slot_pe, slot_tail, bar, DescLat, DescPe, DescTail, KV, BlockTable, b, n0, end, page, stride_kv,
          stride_bt, PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
          rows: gl.constexpr):  # fmt: skip
    """Start copying rows n0 .. n0 + BLOCK_N of sequence b, which lie in cache page `page`, into a ring slot; its
    barrier `bar` (count 1) completes when they have landed. Called by one warpgroup (128 threads, `rows`)."""
    if n0 + BLOCK_N > end:  # the sequence's last tile: cp.async zero-fills the rows past its end
        copy_tile(slot_k, slot_pe, KV, BlockTable, b, n0, end, stride_kv, stride_bt,
                   PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
        tails: gl.constexpr = gl.BlockedLayout([1, TAIL], [32, 1], [4, 1], [1, 0])  # a 16-byte copy per row
        pos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tails))
        tail = KV + (page.to(gl.int64) * PAGE + pos % PAGE) * stride_kv + D_LAT + D_ROPE
        cols = gl.arange(0, TAIL, layout=gl.SliceLayout(0, tails))
        async_load(slot_tail, tail[:, None] + cols[None, :], mask=(pos < end)[:, None])
        async_copy.commit_group()
        # counted as pending now, it arrives once this thread's copies have landed
        async_copy.mbarrier_arrive(bar)
        barrier()  # ... for every thread, before the one arrival that completes the phase
        mbarrier.arrive(bar)
    else:
        row = page * PAGE + n0 % PAGE
        mbarrier.expect(bar, BLOCK_N * (D_LAT + D_ROPE + TAIL))
        chunks = view_as(slot_k, gl.float8e4nv, [LAT_CHUNKS, BLOCK_N, CHUNK], LAT_SMEM3)
        tma_load(DescLat, [0, row, 0], bar, chunks)
        tma_load(DescPe, [row, D_LAT], bar, slot_pe)
        tma_load(DescTail, [row, D_LAT + D_ROPE], bar, slot_tail)


@gluon.jit
def producer(KV, DescLat, DescPe, DescTail, BlockTable, start, end, stride_kv, stride_bt, k_ring, pe_ring,
              tail_ring, ready, empty, PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
              BLOCK_N: gl.constexpr):  # fmt: skip
    """Copy the split's tiles into the ring in order, each once its slot's consumer has released the tile SLOTS before.
    Runs in the default partition with few registers: it only addresses the copies. Each tile's block-table entry is
    read one tile ahead, before the wait for its slot, so the lookup's latency is not between the slot's release and
    the copy's start."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    rows: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16-byte copies
    b = gl.program_id(0)
    tiles = gl.cdiv(end - start, BLOCK_N)
    pages = BlockTable + b * stride_bt
    page = gl.load(pages + start // PAGE, mask=start < end, other=0)
    for t in range(tiles):
        slot = t % SLOTS
        n0 = start + t * BLOCK_N
        next_page = gl.load(pages + (n0 + BLOCK_N) // PAGE, mask=n0 + BLOCK_N < end, other=0)
        mbarrier.wait(empty.index(slot), ((t // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        fill(k_ring.index(slot), pe_ring.index(slot), tail_ring.index(slot), ready.index(slot), DescLat, DescPe,
              DescTail, KV, BlockTable, b, n0, end, page, stride_kv, stride_bt, PAGE, D_LAT, D_ROPE, BLOCK_N,
              rows)  # fmt: skip
        page = next_page
