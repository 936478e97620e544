"""The prefill attention kernel's head split and tile ladder (no triton needed)."""

import pytest

from mlaserve.kernels.fit import DEFAULT_SHARED_BYTES
from mlaserve.kernels.prefill_attn.tiles import (
    DEFAULT_TILE,
    TILE_CANDIDATES,
    HeadSplit,
    PrefillTile,
    head_split,
    shared_bytes,
    tile_ladder,
)


@pytest.mark.parametrize(
    "qk, v, want",
    [
        (192, 128, HeadSplit(128, 64, 128, 64, 128)),  # DeepSeek: two dots of exactly its widths
        (128, 128, HeadSplit(128, 0, 128, 0, 128)),  # one power of two: one dot
        (96, 64, HeadSplit(64, 32, 64, 32, 64)),  # MiniCPM3's 64 + 32
        (24, 16, HeadSplit(16, 8, 16, 16, 16)),  # a remainder narrower than a dot is padded to 16
        (200, 100, HeadSplit(128, 72, 128, 128, 128)),
        (8, 8, HeadSplit(8, 0, 16, 0, 16)),
    ],
)
def test_head_split(qk, v, want):
    assert head_split(qk, v) == want


def test_every_candidate_fits_an_sm90_in_16_bits():
    split = head_split(192, 128)
    assert DEFAULT_TILE in TILE_CANDIDATES
    for tile in TILE_CANDIDATES:
        assert shared_bytes(tile, split, 2) <= DEFAULT_SHARED_BYTES, tile


def test_ladder_moves_down_until_it_fits():
    split = head_split(192, 128)
    # float32 doubles every buffer: the default's query tile and two stages of K and V do not fit
    assert shared_bytes(DEFAULT_TILE, split, 4) > DEFAULT_SHARED_BYTES
    rungs = tile_ladder(DEFAULT_TILE, split, 4, DEFAULT_SHARED_BYTES)
    assert rungs[0] == PrefillTile(128, 32, 8, 2)
    assert shared_bytes(rungs[0], split, 4) <= DEFAULT_SHARED_BYTES
    assert rungs[-1] == PrefillTile(16, 16, 4, 1)
    assert tile_ladder(DEFAULT_TILE, split, 2, DEFAULT_SHARED_BYTES)[0] == DEFAULT_TILE
    assert tile_ladder(DEFAULT_TILE, split, 4, DEFAULT_SHARED_BYTES) is rungs  # cached: found by identity
