"""The prefill attention kernel's tiles: the default, the candidates a benchmark sweeps, and the ladder of
smaller tiles a launch falls down when a tile asks for more shared memory than the device gives.

A tile is (block_m query rows, block_n key rows per step, warps, pipeline stages). The head dimension is split in
two dot widths (`head_split`): the query/key width as a power-of-two part plus the remainder padded to a power of
two, so DeepSeek's 192 = 128 + 64 runs two dots of exactly its widths, and the value width is padded on its own.
No triton import here: the registry and the start-up log read these without a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from mlaserve.kernels.fit import fitting, ladder, pipelined_bytes

# tl.dot wants every dimension at least this wide.
MIN_DOT = 16


class PrefillTile(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int


class HeadSplit(NamedTuple):
    """The query/key head dimension as two dot widths (first, second: the columns each dot takes, second 0 for
    one dot) and their padded tiles, and the value width's tile."""

    first: int
    second: int
    first_tile: int
    second_tile: int
    value_tile: int


# Hopper-shaped: 8 warps over a 128-row query tile keep two warpgroups on the QK and PV dots, 64 key rows per
# step leave room for two stages of K and V next to the query tile at 192 + 128 columns in 16 bits.
DEFAULT_TILE = PrefillTile(128, 64, 8, 2)
# What the GPU suite's prefill128 section sweeps to pick the default: tiles whose sm_90 builds keep their
# accumulators in registers (ptxas reports no spills at 192/128 in 16 bits, but for the 128 x 128 tile, kept as the
# wide end), with one or two programs per SM. Four warps over a 128-row tile spill and are left out.
TILE_CANDIDATES = (
    PrefillTile(128, 64, 8, 2),
    PrefillTile(128, 64, 8, 3),
    PrefillTile(128, 64, 8, 4),
    PrefillTile(128, 32, 8, 3),
    PrefillTile(128, 128, 8, 2),
    PrefillTile(64, 64, 4, 2),
    PrefillTile(64, 64, 4, 3),
    PrefillTile(64, 32, 4, 3),
)


def _pow2_tile(width: int) -> int:
    return max(MIN_DOT, 1 << max(width - 1, 0).bit_length())


def head_split(qk_dim: int, v_dim: int) -> HeadSplit:
    """The largest power of two within qk_dim (at least MIN_DOT), then what is left padded; the value width
    padded. Padded columns load as zeros and add nothing to the dots."""
    first = min(qk_dim, 1 << (qk_dim.bit_length() - 1)) if qk_dim >= MIN_DOT else qk_dim
    second = qk_dim - first
    return HeadSplit(first, second, _pow2_tile(first), _pow2_tile(second) if second else 0, _pow2_tile(v_dim))


def shared_bytes(tile: PrefillTile, split: HeadSplit, elem_bytes: int) -> int:
    """The query tile, held for the whole loop, and `stages` buffers of each step's K and V rows."""
    qk = split.first_tile + split.second_tile
    query = tile.block_m * qk * elem_bytes
    return query + pipelined_bytes(
        tile.stages, elem_bytes, tile.block_n * qk, tile.block_n * split.value_tile
    )


def smaller_tile(tile: PrefillTile) -> PrefillTile | None:
    """Fewer stages first (the tile's shape is what was tuned), then fewer key rows, then fewer query rows."""
    m, n, warps, stages = tile
    if stages > 2:
        return tile._replace(stages=stages - 1)
    if n > 32:
        return tile._replace(block_n=n // 2)
    if m > 64:
        return tile._replace(block_m=m // 2, warps=min(warps, 4))
    if stages > 1:
        return tile._replace(stages=1)
    if m > 16 or n > 16:
        return PrefillTile(16, 16, 4, 1)
    return None


@functools.cache
def tile_ladder(first: PrefillTile, split: HeadSplit, elem_bytes: int, limit: int) -> tuple[PrefillTile, ...]:
    """`first` and the smaller tiles below it, from the first that fits `limit` bytes of shared memory. Cached, so
    fit.first_that_builds finds a call's ladder by identity."""
    return fitting(ladder(first, smaller_tile), lambda t: shared_bytes(t, split, elem_bytes), limit)
