"""What the three Gluon split steps of paged MLA decode share (gluon_wgmma.py, gluon_wgmma8.py, gluon_fp8.py).

Names that moved between Triton versions, the copy of a tile of cache rows into shared memory, the rows of a
sequence that one split covers (spans.split_span's cut, in Gluon), the query load, and the 8-bit kernels' running
state and its normalization. Gluon kernels do not run under TRITON_INTERPRET; tests/gpu checks them against the
Triton kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# Gluon is experimental and renames things: Triton 3.6 calls the asynchronous global -> shared copy
# async_copy_global_to_shared and the CTA barrier thread_barrier; 3.9 async_load (the old name raises) and barrier.
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# Triton 3.6 calls the TMA copy async_copy_global_to_shared, 3.9 async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# ... and a shared-memory view as another dtype _reinterpret, 3.9 reinterpret (`view_as`)
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
CHUNK = gl.constexpr(128)  # latent columns per register operand of the 8-bit kernels


@gluon.jit
def view_as(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The shared memory `smem` viewed as `dtype` in `shape` and `layout`, under either Triton's name for it."""
    if _PUBLIC_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def copy_tile(
    k_dst, pe_dst, KV, BlockTable, b, n0, end, stride_kv, stride_bt,
    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_N: gl.constexpr, rows: gl.constexpr,
):  # fmt: skip
    """Start copying rows n0 .. n0 + BLOCK_N of sequence b into shared memory (rows past `end` are zero-filled).
    Returns the rows' pointers and which rows are in range (the 8-bit kernel reads the row scales behind them)."""
    pos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows))
    ok = pos < end
    if PAGE % BLOCK_N == 0:  # the tile lies inside one page: one table lookup
        page = gl.load(BlockTable + b * stride_bt + n0 // PAGE, mask=n0 < end, other=0).to(gl.int64)
    else:  # a tile spans pages (pages of one row: sparse attention's selected rows): a lookup per row
        page = gl.load(BlockTable + b * stride_bt + pos // PAGE, mask=ok, other=0).to(gl.int64)
    base = KV + (page * PAGE + pos % PAGE) * stride_kv
    lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, rows))
    rope = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rows))
    async_load(k_dst, base[:, None] + lat[None, :], mask=ok[:, None])
    async_load(pe_dst, base[:, None] + D_LAT + rope[None, :], mask=ok[:, None])
    async_copy.commit_group()
    return base, ok


@gluon.jit
def split_range(SeqLens, b, split, num_splits, split_target, BLOCK_N: gl.constexpr, lens: gl.constexpr):
    """Rows [start, end) of sequence b that this split covers, as spans.split_span slices them (each
    sequence's share of batch x split_target splits by its length). lens: a 1-D layout over the caller's warps."""
    seq_len = gl.load(SeqLens + b)
    batch = gl.num_programs(0)
    idx = gl.arange(0, 512, layout=lens)
    total = gl.sum(gl.load(SeqLens + idx, mask=idx < batch, other=0), 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        total += gl.sum(gl.load(SeqLens + i + idx, mask=i + idx < batch, other=0), 0)
    # round(split_target x seq_len / mean length), in float32: exact for equal lengths, no 64-bit products
    mean = gl.maximum(total, 1).to(gl.float32) / batch
    share = (seq_len.to(gl.float32) * split_target / mean + 0.5).to(gl.int32)
    count = gl.minimum(gl.maximum(share, 1), num_splits)
    split_len = gl.cdiv(gl.cdiv(seq_len, count), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, gl.minimum(start + split_len, seq_len)


@gluon.jit
def store_empty_lse(MidLse, b, head0, split, num_heads, stride_mlb, stride_mlh, BLOCK_H: gl.constexpr,
                     layout: gl.constexpr):  # fmt: skip
    """An empty split's LSE (-inf) for heads head0 .. head0 + BLOCK_H: the merge then reads nothing else of it."""
    heads = head0 + gl.arange(0, BLOCK_H, layout=layout)
    lse = gl.full([BLOCK_H], float("-inf"), gl.float32, layout)
    gl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=heads < num_heads)


@gluon.jit
def load_queries(
    Q, QPe, b, head0, num_heads, stride_qb, stride_qh, stride_pb, stride_ph,
    BLOCK_H: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr, rows: gl.constexpr,
):  # fmt: skip
    """The latent and rope parts of heads head0 .. head0 + BLOCK_H of sequence b (zero past num_heads)."""
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    head_ok = heads < num_heads
    lat = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, rows))
    rope = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rows))
    q = gl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + lat[None, :], mask=head_ok[:, None], other=0.0
    )
    q_pe = gl.load(
        QPe + b * stride_pb + heads[:, None] * stride_ph + rope[None, :], mask=head_ok[:, None], other=0.0
    )
    return q, q_pe


@gluon.jit
def empty_state(outs: gl.constexpr, scores: gl.constexpr, BLOCK_N: gl.constexpr):
    """A split's running state before its first tile, for both 8-bit kernels: Oᵀ in four chunks of CHUNK latent
    columns (heads as N, in `outs`), the heads' running max, and p's sums per row (in `scores`, reduced once at the
    end by normalizers)."""
    BLOCK_H: gl.constexpr = outs.instr_shape[1]
    acc0 = gl.zeros([CHUNK, BLOCK_H], gl.float32, outs)
    acc1 = gl.zeros([CHUNK, BLOCK_H], gl.float32, outs)
    acc2 = gl.zeros([CHUNK, BLOCK_H], gl.float32, outs)
    acc3 = gl.zeros([CHUNK, BLOCK_H], gl.float32, outs)
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, scores))
    return acc0, acc1, acc2, acc3, m, gl.zeros([BLOCK_N, BLOCK_H], gl.float32, scores)


@gluon.jit
def normalizers(m, l_sum, outs: gl.constexpr, LSE_SHIFT: gl.constexpr):
    """For both 8-bit kernels, from a split's running max m and the sum of its p per head: each head's base-2 LSE,
    m + log2(sum) - LSE_SHIFT (-inf for an empty split), and 1 / sum in `outs`' head slice, to scale Oᵀ by."""
    has = l_sum > 0
    lse2 = gl.where(has, m + gl.log2(gl.where(has, l_sum, 1.0)) - LSE_SHIFT, float("-inf"))
    return lse2, gl.convert_layout(1.0 / gl.where(has, l_sum, 1.0), gl.SliceLayout(0, outs))


@gluon.jit
def store_lse(MidLse, lse2, b, head0, split, num_heads, stride_mlb, stride_mlh):
    """Write a split's per-head LSE (normalizers) for both 8-bit kernels."""
    l_heads = head0 + gl.arange(0, lse2.shape[0], layout=lse2.type.layout)
    gl.store(MidLse + b * stride_mlb + l_heads * stride_mlh + split, lse2, mask=l_heads < num_heads)
