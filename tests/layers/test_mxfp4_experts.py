"""MXFP4 experts split by width over tensor-parallel ranks: each rank loads its slice of every expert's packed bytes
and e8m0 scales from the full checkpoint tensors, and the ranks' partial sums add up to the whole experts' output
(the MoE layer's all-reduce)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mlaserve.layers import mxfp4
from mlaserve.layers.mxfp4_experts import MXFP4Experts, experts_reference
from mlaserve.loader.checkpoint_slice import CheckpointSlice
from mlaserve.loader.safetensors_reader import iter_safetensor_slices
from mlaserve.parallel import ParallelContext

NUM, HIDDEN, LIMIT = 4, 64, 1.5


def _checkpoint(inter: int, gen: torch.Generator) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(expert, w1 / w2 / w3) -> (packed, scales) as a checkpoint stores them, every rank's width in one tensor."""
    shapes = {"w1": (inter, HIDDEN), "w3": (inter, HIDDEN), "w2": (HIDDEN, inter)}
    return {
        (e, name): mxfp4.quantize(torch.randn(*shape, generator=gen) * (0.2 if name == "w2" else 1.0))
        for e in range(NUM)
        for name, shape in shapes.items()
    }


def _save(checkpoint: dict, folder: Path) -> Path:
    """The checkpoint as a safetensors file, typed like V4's (int8 bytes, e8m0 scales)."""
    tensors = {}
    for (e, name), (packed, scales) in checkpoint.items():
        tensors[f"experts.{e}.{name}.weight"] = packed.view(torch.int8)
        tensors[f"experts.{e}.{name}.scale"] = scales.view(torch.float8_e8m0fnu)
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _load(layer: MXFP4Experts, folder: Path) -> None:
    """Through the layer's weight loader, from unread checkpoint slices, as loader/weights.py calls it."""
    for name, loaded in iter_safetensor_slices(folder):
        _, e, proj, kind = name.split(".")
        params = (layer.w2, layer.w2_scale) if proj == "w2" else (layer.w13, layer.w13_scale)
        shard = int(e) if proj == "w2" else (int(e), 0 if proj == "w1" else 1)
        assert isinstance(loaded, CheckpointSlice)
        layer.load(params[kind == "scale"], loaded, shard)


@pytest.mark.parametrize("inter,size", [(64, 2), (128, 4), (96, 3)])
def test_ranks_partial_sums_equal_the_whole_experts(inter: int, size: int, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(inter + size)
    checkpoint = _save(_checkpoint(inter, gen), tmp_path)
    whole = MXFP4Experts(NUM, HIDDEN, inter, LIMIT)
    _load(whole, checkpoint)
    x = torch.randn(9, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    ranks = [MXFP4Experts(NUM, HIDDEN, inter, LIMIT, ParallelContext(r, size)) for r in range(size)]
    for rank in ranks:
        _load(rank, checkpoint)
        assert rank.w2.shape == (NUM, HIDDEN, inter // size // 2)
        assert rank.w2_scale.shape == (NUM, HIDDEN, inter // size // 32)
    with torch.no_grad():
        want = whole(x, ids, weights)
        got = sum(rank(x, ids, weights) for rank in ranks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each rank holds its own rows of w1 and w3 and its own columns of w2, in rank order
    part = inter // size
    last = ranks[-1]
    torch.testing.assert_close(last.w13[:, :part], whole.w13[:, inter - part : inter])
    torch.testing.assert_close(last.w13_scale[:, part:], whole.w13_scale[:, 2 * inter - part :])
    torch.testing.assert_close(last.w2, whole.w2[..., (inter - part) // 2 :])
    torch.testing.assert_close(last.w2_scale, whole.w2_scale[..., (inter - part) // 32 :])
    # the reference over the whole dequantized weights, for the sum of the ranks
    ref = experts_reference(x, whole.w13, whole.w13_scale, whole.w2, whole.w2_scale, ids, weights, LIMIT)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_split_that_cuts_scale_groups_is_refused_with_the_widths() -> None:
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(96\) split over 2 ranks gives 48 columns"):
        MXFP4Experts(NUM, HIDDEN, 96, LIMIT, ParallelContext(0, 2))
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size"):
        MXFP4Experts(NUM, HIDDEN, 64, LIMIT, ParallelContext(0, 3))


def test_a_checkpoint_tensor_of_another_width_is_refused() -> None:
    rank = MXFP4Experts(NUM, HIDDEN, 64, LIMIT, ParallelContext(1, 2))
    packed, _ = mxfp4.quantize(torch.randn(HIDDEN, 96))
    with pytest.raises(ValueError, match=r"checkpoint shape \(64, 48\), expected \(64, 16\)"):
        rank.load(rank.w2, packed, 0)
