"""Which rows of the batch each program of a split step takes: split shares or balanced spans (DecodePlan.balanced).

Split shares: program (b, split) takes one slice of sequence b, each sequence its share of batch x split_target
slices by its length. Balanced spans: the batch's tiles are laid end to end and program c takes an equal run of
them, over as many sequences as the run touches, so a batch of uneven lengths does not wait on the slices of its
longest sequences; the merge finds each sequence's programs from the lengths alone (sequence_programs).
"""

import triton
import triton.language as tl


@triton.jit
def split_span(SeqLens, b, split, num_splits, split_target, window, BLOCK_N: tl.constexpr):
    """Rows [start, end) of sequence b that split `split` covers (empty past the sequence's share of splits), and
    the first row it may attend to (0, or with a window the window's first: rows before it are masked).

    The batch takes batch x split_target splits, each sequence its share by length: round(split_target x its length
    / the mean length), at least 1 and at most num_splits (the grid's), its rows spread evenly over them in whole
    tiles. Equal lengths take split_target each, as the measured rules do; a sequence four times the mean length
    takes four times as many, so it does not run alone at the end. A CUDA graph sizes the grid for max_model_len
    (rules.grid_splits), so the lengths are read here: all of them, from the device. A window's rows are at most
    `window` in every sequence: each takes split_target splits over them, from the tile its window starts in, so
    tiles stay whole pages' runs as without a window."""
    seq_len = tl.load(SeqLens + b)
    batch = tl.num_programs(0)
    idx = tl.arange(0, 512)
    total = tl.sum(tl.load(SeqLens + idx, mask=idx < batch, other=0), 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        total += tl.sum(tl.load(SeqLens + i + idx, mask=i + idx < batch, other=0), 0)
    # round(split_target x seq_len / mean length), in float32: exact for equal lengths, no 64-bit products
    mean = tl.maximum(total, 1).to(tl.float32) / batch
    share = (seq_len.to(tl.float32) * split_target / mean + 0.5).to(tl.int32)
    share = tl.where(window > 0, split_target, share)
    count = tl.minimum(tl.maximum(share, 1), num_splits)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first = lo // BLOCK_N * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(seq_len - first, count), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    return start, tl.minimum(start + split_len, seq_len), lo


@triton.jit
def tiles_of(SeqLens, i, batch, BLOCK_N: tl.constexpr):
    """Tiles of BLOCK_N rows of sequences i .. i + 511 (0 past the batch), and which of them are in the batch."""
    idx = tl.arange(0, 512)
    ok = i + idx < batch
    return tl.cdiv(tl.load(SeqLens + i + idx, mask=ok, other=0), BLOCK_N), ok


@triton.jit
def per_program(total, num_ctas, MIN_TILES: tl.constexpr):
    """Balanced spans: how many of the batch's `total` tiles each program takes, an equal share, at least
    MIN_TILES."""
    return tl.maximum(tl.cdiv(total, num_ctas), MIN_TILES)


@triton.jit
def program_span(SeqLens, batch, cta, num_ctas, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Program cta's span of the batch's tiles laid end to end, [t0, t1), the first sequence it touches, the tiles
    before that one, and the end of the sequences it touches (exclusive; sequences of no rows touch nothing). The
    first 512 lengths are read once, for both the total and the search."""
    tiles, ok = tiles_of(SeqLens, 0, batch, BLOCK_N)
    total = tl.sum(tiles, 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        more, _ = tiles_of(SeqLens, i, batch, BLOCK_N)
        total += tl.sum(more, 0)
    per = per_program(total, num_ctas, MIN_TILES)
    t0 = cta * per
    t1 = tl.minimum(t0 + per, total)
    ends = tl.cumsum(tiles, 0)
    done = ok & (ends <= t0)
    first = tl.sum(done.to(tl.int32), 0)
    before = tl.sum(tl.where(done, tiles, 0), 0)
    stop = tl.sum((ok & (ends < t1)).to(tl.int32), 0) + 1
    run = tl.sum(tiles, 0)
    for i in range(512, batch, 512):
        tiles, ok = tiles_of(SeqLens, i, batch, BLOCK_N)
        ends = run + tl.cumsum(tiles, 0)
        done = ok & (ends <= t0)
        first += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, tiles, 0), 0)
        stop += tl.sum((ok & (ends < t1)).to(tl.int32), 0)
        run += tl.sum(tiles, 0)
    return t0, t1, first, before, stop


@triton.jit
def sequence_programs(SeqLens, batch, b, num_ctas, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """The first program whose balanced span touches sequence b, and how many do (0 for no rows)."""
    tiles, ok = tiles_of(SeqLens, 0, batch, BLOCK_N)
    idx = tl.arange(0, 512)
    total = tl.sum(tiles, 0)
    before = tl.sum(tl.where(idx < b, tiles, 0), 0)
    for i in range(512, batch, 512):  # batches past 512 rows
        more, _ = tiles_of(SeqLens, i, batch, BLOCK_N)
        total += tl.sum(more, 0)
        before += tl.sum(tl.where(i + idx < b, more, 0), 0)
    per = per_program(total, num_ctas, MIN_TILES)
    own = tl.cdiv(tl.load(SeqLens + b), BLOCK_N)
    first = before // per
    return first, tl.where(own > 0, (before + own - 1) // per - first + 1, 0)
