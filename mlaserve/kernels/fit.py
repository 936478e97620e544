"""Tiles that fit the device a kernel runs on.

A tile tuned for bf16 on one GPU can ask for more shared memory than another dtype or another GPU gives a program
(float32 doubles every buffer Triton's pipeliner keeps). So each kernel with tiles (a) estimates its tile's shared
memory for the dtype at hand and takes the first rung of a ladder of smaller tiles that fits what the device
offers, and (b) launches through `first_that_builds`, which moves down the same ladder if a compiled kernel still
asks for more than the device has (shared memory, or threads at its register count): Triton raises OutOfResources
before anything runs, so the next rung is a safe retry, and the rung that built is remembered for the next call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

# What a program may take where no GPU can be asked (the CPU interpreter): an sm_90 GPU's opt-in limit, so plans
# made on CPU are those of an H100/H200.
DEFAULT_SHARED_BYTES = 232_448


@functools.cache
def _cuda_shared_bytes(index: int) -> int:
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - Triton's driver layer differs between versions; torch knows it too
        return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def shared_memory_limit(device: torch.device | str) -> int:
    """The shared memory one program may take on `device` (bytes): the GPU's opt-in per-block limit on CUDA,
    DEFAULT_SHARED_BYTES elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_SHARED_BYTES
    return _cuda_shared_bytes(device.index if device.index is not None else torch.cuda.current_device())


def pipelined_bytes(stages: int, elem_bytes: int, *tile_elems: int) -> int:
    """Shared memory of a loop whose operand tiles (`tile_elems` elements each) Triton's pipeliner streams through
    `stages` buffers apiece; it matched the compiled grouped GEMM's figure exactly in float32."""
    return stages * elem_bytes * sum(tile_elems)


def ladder(first: T, shrink: Callable[[T], T | None]) -> tuple[T, ...]:
    """`first`, then each smaller tile `shrink` gives, until it gives None."""
    rungs = [first]
    while (smaller := shrink(rungs[-1])) is not None:
        rungs.append(smaller)
    return tuple(rungs)


def fitting(rungs: Sequence[T], shared_bytes: Callable[[T], int], limit: int) -> tuple[T, ...]:
    """The ladder from its first rung whose estimate is within `limit` (its last rung if none is)."""
    for i, rung in enumerate(rungs):
        if shared_bytes(rung) <= limit:
            return tuple(rungs[i:])
    return tuple(rungs[-1:])


# Which rung of a ladder built, for ladders where the first did not: keyed by the ladder object (the kernels' ladders
# are cached, so a call finds its own in one lookup without hashing every tile), which the entry holds so its id is
# never reused. Filled once per shape and never cleared, as Triton's own kernel cache is.
_BUILT: dict[int, tuple[Sequence[object], int]] = {}


def first_that_builds(name: str, rungs: Sequence[T], launch: Callable[[T], R]) -> R:
    """launch(rung) for the first rung from the top of `rungs` whose kernel the device can run; a rung that does
    not is skipped from then on. Raises the last rung's error, naming the kernel, if none can."""
    from triton.runtime.errors import OutOfResources

    held = _BUILT.get(id(rungs))
    start = held[1] if held is not None and held[0] is rungs else 0
    for i in range(start, len(rungs)):
        try:
            result = launch(rungs[i])
        except OutOfResources as error:
            if i == len(rungs) - 1:
                error.add_note(f"{name}: no tile of its ladder fits this device ({len(rungs)} tried)")
                raise
            continue
        if i != start:
            _BUILT[id(rungs)] = (rungs, i)
        return result
    raise AssertionError("unreachable: the last rung returns or raises")  # pragma: no cover


class GemmTile(NamedTuple):
    """A Triton GEMM's tile: output columns and reduction depth per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def smaller_gemm_tile(tile: GemmTile) -> GemmTile | None:
    """The next rung down: fewer stages first (the tile's shape is what was tuned), then a shallower K step, then
    narrower N, then no pipelining, then the smallest dot (16 x 16)."""
    n, k, warps, stages = tile
    if stages > 2:
        return tile._replace(stages=stages - 1)
    if k > 32:
        return tile._replace(block_k=k // 2)
    if n > 32:
        return tile._replace(block_n=n // 2)
    if stages > 1:
        return tile._replace(stages=1)
    if k > 16 or n > 16:
        return tile._replace(block_k=16, block_n=16)
    return None


def gemm_tiles(
    first: GemmTile, block_m: int, elem_bytes: int, b_operands: int, limit: int
) -> tuple[GemmTile, ...]:
    """The ladder below `first` from its first rung that fits `limit`: an [block_m, block_k] A tile and
    `b_operands` [block_k, block_n] B tiles per stage."""

    def shared_bytes(tile: GemmTile) -> int:
        return pipelined_bytes(
            tile.stages, elem_bytes, block_m * tile.block_k, b_operands * tile.block_k * tile.block_n
        )

    return fitting(ladder(first, smaller_gemm_tile), shared_bytes, limit)
