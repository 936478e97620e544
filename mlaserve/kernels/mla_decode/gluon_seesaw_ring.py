"""The producer of the seesaw decode kernel (gluon_seesaw.py): the warpgroup that copies the queries and then each
tile of cache rows into a free slot of the ring, and the TMA descriptors it may copy whole tiles with.

Every slot has a `ready` barrier of count 1. A tile comes by one of two paths:
- cp.async (any page size; a tile may span pages, each row's page looked up): every producer thread's copies are
  counted on the barrier as pending, and one arrival after a warpgroup barrier completes the phase once all have
  landed. Rows past the sequence's end are zero-filled: they may hold a freed page's bytes, NaN included, and p = 0
  does not cancel a NaN in the values' dot.
- TMA (the plan's `tma`, pages a multiple of the tile, rows 16-byte aligned): a whole tile inside one page as two
  boxes, the latent part as one 3-D box of 64-column chunks (one copy instruction, in the layout eight [rows, 64]
  boxes would give it: the 128-byte swizzle keeps each chunk whole) and the rope part, counted in bytes on the
  barrier. A sequence's last, partial tile and the all-masked partner of an odd last tile still come by cp.async,
  for the zero fill.
FlashMLA copies by TMA; which path is faster here is for the GPU suite to say (benchmarks/gpu_kernels.seesaw_rows).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlaserve.kernels.mla_decode.gluon_common import async_load, barrier, copy_tile, tma_load, view_as

# A 16-bit tile's latent part as TMA copies it: [chunks, rows, 64], 64 columns (128 bytes) a chunk.
LAT_CHUNK = gl.constexpr(64)
LAT_SMEM3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
ROWS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


def tma_descriptors(kv: torch.Tensor, d_lat: int, d_rope: int, block_n: int) -> tuple[TensorDescriptor, ...]:
    """Descriptors over the 16-bit cache's rows kv [rows, d_lat + d_rope] for the producer's TMA path: the latent
    part as [d_lat / 64, rows, 64] (each chunk of 64 columns its own dimension) in boxes of [d_lat / 64, block_n,
    64], and boxes of block_n rows by the rope part. kv's rows must start 16-byte aligned (rules.tma_rows)."""
    chunks, chunk = d_lat // LAT_CHUNK.value, LAT_CHUNK.value
    shape, strides = list(kv.shape), [kv.stride(0), 1]
    return (
        TensorDescriptor(kv, [chunks, shape[0], chunk], [chunk, strides[0], 1], [chunks, block_n, chunk],
                         LAT_SMEM3.value),
        TensorDescriptor(kv, shape, strides, [block_n, d_rope], ROWS_SMEM.value),
    )  # fmt: skip


@gluon.jit
def _arrive_when_copied(bar):
    """Complete `bar`'s phase (count 1) once every producer thread's pending cp.async copies have landed."""
    async_copy.mbarrier_arrive(bar)  # counted as pending now, it arrives when this thread's copies land
    barrier()  # ... for every thread, before the one arrival that completes the phase
    mbarrier.arrive(bar)


@gluon.jit
def _load_queries(Q, QPe, b, head0, num_heads, stride_qb, stride_qh, stride_pb, stride_ph, q_s, qpe_s, q_ready,
                   rows: gl.constexpr):  # fmt: skip
    """Copy heads head0 .. head0 + BLOCK_H of sequence b's query (zero past num_heads); `q_ready` completes when
    they have landed."""
    BLOCK_H: gl.constexpr = q_s.shape[0]
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    ok = (heads < num_heads)[:, None]
    lat = gl.arange(0, q_s.shape[1], layout=gl.SliceLayout(0, rows))
    rope = gl.arange(0, qpe_s.shape[1], layout=gl.SliceLayout(0, rows))
    async_load(q_s, Q + b * stride_qb + heads[:, None] * stride_qh + lat[None, :], mask=ok)
    async_load(qpe_s, QPe + b * stride_pb + heads[:, None] * stride_ph + rope[None, :], mask=ok)
    async_copy.commit_group()
    _arrive_when_copied(q_ready)


@gluon.jit
def producer(
    Q, QPe, KV, DescLat, DescPe, BlockTable, start, end, b, head0, num_heads, stride_qb, stride_qh, stride_pb,
    stride_ph, stride_kv, stride_bt, q_s, qpe_s, k_ring, pe_ring, q_ready, ready, empty,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr, TMA: gl.constexpr,
):  # fmt: skip
    """Copy the queries, then the split's tiles in pairs (an odd last tile gets an all-masked partner, zero-filled, so
    both consumers see whole pairs), each into its ring slot once both consumers have released the tile SLOTS
    before. Runs in the default partition with few registers: it only addresses the copies."""
    SLOTS: gl.constexpr = k_ring.shape[0]
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte copies, 128-byte row runs
    _load_queries(Q, QPe, b, head0, num_heads, stride_qb, stride_qh, stride_pb, stride_ph, q_s, qpe_s, q_ready,
                   rows)  # fmt: skip
    for t in range(2 * gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)):
        slot = t % SLOTS
        n0 = start + t * BLOCK_N
        mbarrier.wait(empty.index(slot), ((t // SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        bar = ready.index(slot)
        if TMA and n0 + BLOCK_N <= end:  # a whole tile, inside one page (PAGE % BLOCK_N == 0)
            page = gl.load(BlockTable + b * stride_bt + n0 // PAGE)
            row = page * PAGE + n0 % PAGE
            mbarrier.expect(bar, BLOCK_N * (D_LAT + D_ROPE) * KV.dtype.element_ty.primitive_bitwidth // 8)
            chunks = view_as(k_ring.index(slot), KV.dtype.element_ty, [D_LAT // LAT_CHUNK, BLOCK_N, LAT_CHUNK],
                             LAT_SMEM3)  # fmt: skip
            tma_load(DescLat, [0, row, 0], bar, chunks)
            tma_load(DescPe, [row, D_LAT], bar, pe_ring.index(slot))
        else:
            copy_tile(k_ring.index(slot), pe_ring.index(slot), KV, BlockTable, b, n0, end, stride_kv, stride_bt,
                       PAGE, D_LAT, D_ROPE, BLOCK_N, rows)  # fmt: skip
            _arrive_when_copied(bar)
    async_copy.wait_group(0)  # no cp.async still in flight when the producer's warps exit
