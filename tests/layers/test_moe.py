"""The experts split over ranks (layers/moe.py): each rank's part, summed as the all-reduce would, equals the whole
layer, for expert parallelism (whole experts per rank) and tensor parallelism (each expert's width split)."""

import pytest
import torch

from mlaserve.layers.moe import FusedExperts, experts_reference
from mlaserve.parallel import ParallelContext

E, HIDDEN, INTER = 6, 16, 8


def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for e in range(E):
        for which in (0, 1):  # gate, up: [INTER, HIDDEN]
            weights[f"w13.{e}.{which}"] = torch.randn(INTER, HIDDEN, generator=gen)
        weights[f"w2.{e}"] = torch.randn(HIDDEN, INTER, generator=gen)  # down
    return weights


def build(ctx: ParallelContext) -> FusedExperts:
    layer = FusedExperts(E, HIDDEN, INTER, "silu", ctx)
    for name, tensor in checkpoint().items():
        if name.startswith("w13"):
            _, e, which = name.split(".")
            layer.load_w13(layer.w13, tensor, (int(e), int(which)))
        else:
            layer.load_w2(layer.w2, tensor, int(name.split(".")[1]))
    return layer


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp"])
def test_ranks_parts_sum_to_the_whole_layer(expert_parallel: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    whole = build(ParallelContext())(x, weights, ids)
    # no process group: each rank's output is its partial sum, before the all-reduce
    ranks = [build(ParallelContext(r, 2, expert_parallel=expert_parallel)) for r in range(2)]
    if expert_parallel:
        assert [r.w13.shape[0] for r in ranks] == [E // 2, E // 2]
    else:
        assert [r.w13.shape[1] for r in ranks] == [INTER, INTER]  # gate + up halves: 2 * INTER / 2
    total = sum(rank(x, weights, ids) for rank in ranks)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_reference_skips_routes_to_other_ranks() -> None:
    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(3, 2 * INTER, HIDDEN, generator=gen), torch.randn(3, HIDDEN, INTER, generator=gen)
    x, weights = torch.randn(4, HIDDEN, generator=gen), torch.rand(4, 2, generator=gen)
    ids = torch.tensor([[0, -1], [-1, -1], [2, 1], [1, -1]])
    kept = torch.where(ids >= 0, weights, 0.0)
    act = torch.nn.functional.silu
    got = experts_reference(x, w13, w2, weights, ids, act)
    want = experts_reference(x, w13, w2, kept, ids.clamp(min=0), act)  # a -1 route weighs nothing
    torch.testing.assert_close(got, want)
    assert got[1].abs().max() == 0
