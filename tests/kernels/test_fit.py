"""kernels/fit.py: tiles chosen within the device's shared memory, and the fall back to smaller ones when a
compiled kernel still does not fit."""

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from mlaserve.kernels import fit  # noqa: E402
from mlaserve.kernels.fit import GemmTile  # noqa: E402

H200 = fit.DEFAULT_SHARED_BYTES


def test_off_cuda_the_limit_is_an_sm90_gpus():
    assert fit.shared_memory_limit("cpu") == H200 == fit.shared_memory_limit(torch.device("cpu"))


def test_float32_64_row_gated_tile_is_cut_to_fit():
    """The bf16-tuned 64-row tile (128 x 64, 3 stages) asks float32 for 3 * 4 * (64*64 + 2*64*128) = 245,760
    bytes, past an H200's 232,448: the ladder drops a stage first."""
    tuned = GemmTile(128, 64, 4, 3)
    assert fit.pipelined_bytes(3, 4, 64 * 64, 2 * 64 * 128) == 245_760
    assert fit.gemm_tiles(tuned, 64, 4, 2, H200)[0] == GemmTile(128, 64, 4, 2)
    assert fit.gemm_tiles(tuned, 64, 2, 2, H200)[0] == tuned  # bf16 keeps the tuned tile


def test_gemm_ladder_shrinks_to_the_smallest_dot():
    rungs = fit.ladder(GemmTile(128, 128, 4, 4), fit.smaller_gemm_tile)
    assert rungs[0] == GemmTile(128, 128, 4, 4) and rungs[-1] == GemmTile(16, 16, 4, 1)
    sizes = [fit.pipelined_bytes(t.stages, 4, 64 * t.block_k, t.block_k * t.block_n) for t in rungs]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))  # every rung takes less shared memory than the last
    assert len(set(rungs)) == len(rungs)


def test_fitting_keeps_the_last_rung_when_none_fits():
    assert fit.fitting((3, 2, 1), lambda r: r * 100, 150) == (1,)
    assert fit.fitting((3, 2, 1), lambda r: r * 100, 250) == (2, 1)
    assert fit.fitting((3, 2, 1), lambda r: r * 100, 10) == (1,)


def test_first_that_builds_moves_down_and_remembers():
    tried: list[int] = []

    def launch(rung: int) -> str:
        tried.append(rung)
        if rung > 2:
            raise OutOfResources(rung * 1000, 2500, "shared memory")
        return f"ran {rung}"

    rungs = (5, 4, 3, 2, 1)
    assert fit.first_that_builds("test-kernel", rungs, launch) == "ran 2"
    assert tried == [5, 4, 3, 2]
    tried.clear()
    assert fit.first_that_builds("test-kernel", rungs, launch) == "ran 2"
    assert tried == [2]  # the rung that built is where the next call starts


def test_first_that_builds_raises_when_no_rung_builds():
    def launch(rung: int) -> None:
        raise OutOfResources(rung, 0, "shared memory")

    with pytest.raises(OutOfResources):
        fit.first_that_builds("never-builds", (2, 1), launch)


def test_other_errors_are_not_retried():
    calls: list[int] = []

    def launch(rung: int) -> None:
        calls.append(rung)
        raise ValueError("a bug, not a resource limit")

    with pytest.raises(ValueError):
        fit.first_that_builds("buggy", (2, 1), launch)
    assert calls == [2]
