"""On a Hopper GPU (skipped elsewhere): the seesaw split step (gluon_seesaw.py) against the torch reference, outputs
and LSEs, eagerly and replayed from a CUDA graph, at 64, 128 and 80 heads (80: the second head group is 16 heads
and 48 masked ones), pages of 1, 16 and 64 rows (a 32- or 64-row tile spans pages below its size), both tile sizes,
tiles by cp.async and by TMA, scores issued a pair ahead or not, and ragged lengths: one row, lengths either side of a tile and of a pair of tiles,
and long ones. The kernel is off by default (rules.SEESAW_BY_DEFAULT), so these name it."""

import pytest
import torch

from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned
from mlaserve.testing.paged_case import LAT, ROPE, paged_case
from tests.gpu.test_mla_decode_on_gpu import check_eager_and_replayed

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="the Gluon seesaw kernel needs sm_90")

# One row (one masked tile, its partner all padding), 31 / 33 (either side of a 32-row tile), 95 (three tiles: an
# odd count), 129 (a pair and a row), then longer ones not multiples of any tile.
LENGTHS = [1, 31, 33, 95, 129, 1000, 2047, 3001]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("length", [1, 32, 33, 64, 65, 128, 129])
def test_one_sequence_one_split(length, block_n, tma):
    """The smallest cases first, to read a failure by: one sequence, one split, 64 heads, a length that ends a tile,
    a pair, or a row past either."""
    q, cache, table, meta = paged_case(1, 64, [length], 64, torch.bfloat16, seed=length)
    options = dict(kernel="gluon_seesaw", block_n=block_n, tma=tma, num_splits=1)
    check_eager_and_replayed(
        q, cache, meta, lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 256, LAT, 0.07, **options)
    )


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("page, tma", [(1, False), (16, False), (64, False), (64, True)])
@pytest.mark.parametrize("heads", [64, 128, 80])
def test_seesaw_matches_reference_eager_and_in_a_graph(heads, page, tma, block_n):
    """tma: whole tiles by TMA, the partial last tile and an odd tile's partner still by cp.async."""
    q, cache, table, meta = paged_case(len(LENGTHS), heads, LENGTHS, page, torch.bfloat16, seed=heads + page)
    options = dict(kernel="gluon_seesaw", block_n=block_n, tma=tma)
    plan = decode_plan(q, cache, 8192, LAT, ROPE, **options)
    assert (plan.block_n, plan.tma) == (block_n, tma)
    check_eager_and_replayed(
        q, cache, meta, lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, **options)
    )


@pytest.mark.parametrize("block_n, tma", [(32, False), (32, True), (64, True)])
@pytest.mark.parametrize("heads", [128, 80])
def test_prefetched_scores_match_reference(heads, block_n, tma):
    """prefetch: consumer 0 issues the next pair's score dots behind its last value dot (and, past the last pair,
    dots over a stale slot whose scores go unused)."""
    q, cache, table, meta = paged_case(len(LENGTHS), heads, LENGTHS, 64, torch.bfloat16, seed=heads + block_n)
    options = dict(kernel="gluon_seesaw", block_n=block_n, tma=tma, prefetch=True)
    assert decode_plan(q, cache, 8192, LAT, ROPE, **options).prefetch
    check_eager_and_replayed(
        q, cache, meta, lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, **options)
    )


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_every_split_count_covers_each_context_once(num_splits):
    """Named split counts: one slice per sequence (the longest loops), slices of odd tile counts, and more splits
    than a short sequence has tiles (empty splits, whose LSE the merge skips)."""
    q, cache, table, meta = paged_case(len(LENGTHS), 128, LENGTHS, 64, torch.bfloat16, seed=num_splits)
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(
            q, cache, table, meta.seq_lens, 4096, LAT, 0.07, kernel="gluon_seesaw", num_splits=num_splits
        ),
    )


@pytest.mark.parametrize("tma", [False, True])
def test_rows_past_the_end_never_reach_the_output(tma):
    """The rows after each sequence's end in its last page, and the never-used block 0, hold NaN (a freed page's
    bytes may): the copy zero-fills them and the scores mask them, so no NaN reaches p or the values' dot."""
    lengths = [1, 45, 96, 100, 777]  # 96: whole 32-row tiles, the pair's partner past the end
    q, cache, table, meta = paged_case(len(lengths), 128, lengths, 64, torch.bfloat16, seed=7)
    options = dict(kernel="gluon_seesaw", tma=tma)
    clean, clean_lse = mla_decode_tuned(q, cache, table, meta.seq_lens, 1024, LAT, 0.07, **options)
    for i, n in enumerate(lengths):
        cache[table[i, n // 64], n % 64 :] = float("nan")
    cache[0] = float("nan")
    out, lse = mla_decode_tuned(q, cache, table, meta.seq_lens, 1024, LAT, 0.07, **options)
    assert torch.equal(out, clean) and torch.equal(lse, clean_lse)


def test_fp16_and_the_64_head_kernel_agree():
    """fp16 queries and cache, and the seesaw kernel against gluon_wgmma (same work, other schedule)."""
    q, cache, table, meta = paged_case(len(LENGTHS), 128, LENGTHS, 64, torch.float16, seed=3)
    check_eager_and_replayed(
        q,
        cache,
        meta,
        lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, kernel="gluon_seesaw"),
    )
    q, cache, table, meta = paged_case(len(LENGTHS), 128, LENGTHS, 64, torch.bfloat16, seed=4)
    seesaw, seesaw_lse = mla_decode_tuned(
        q, cache, table, meta.seq_lens, 8192, LAT, 0.07, kernel="gluon_seesaw"
    )
    wgmma, wgmma_lse = mla_decode_tuned(q, cache, table, meta.seq_lens, 8192, LAT, 0.07, kernel="gluon_wgmma")
    torch.testing.assert_close(seesaw.float(), wgmma.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(seesaw_lse, wgmma_lse, atol=2e-3, rtol=2e-3)
