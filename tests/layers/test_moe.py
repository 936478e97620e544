"""The experts split over ranks (layers/moe.py): each rank's part, summed as the all-reduce would, equals the whole
layer, for expert parallelism (whole experts per rank) and tensor parallelism (each expert's width split); shared
experts stored after the routed ones equal the shared MLP they are loaded from."""

import pytest
import torch

from mlaserve.layers.moe import FusedExperts, experts_reference, with_shared_experts
from mlaserve.loader.checkpoint_slice import ShapeMismatch
from mlaserve.models.llama import GatedMLP
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


SHARED = 2


def shared_checkpoint() -> dict[str, torch.Tensor]:
    """A checkpoint's one shared MLP of SHARED x INTER."""
    gen = torch.Generator().manual_seed(3)
    return {
        "gate_proj": torch.randn(SHARED * INTER, HIDDEN, generator=gen),
        "up_proj": torch.randn(SHARED * INTER, HIDDEN, generator=gen),
        "down_proj": torch.randn(HIDDEN, SHARED * INTER, generator=gen),
    }


def build_with_shared(ctx: ParallelContext) -> FusedExperts:
    routed = build(ctx)
    layer = FusedExperts(E, HIDDEN, INTER, "silu", ctx, num_shared=SHARED)
    layer.w13.data[:E], layer.w2.data[:E] = routed.w13.data, routed.w2.data
    shared = shared_checkpoint()
    layer.load_w13(layer.w13, shared["gate_proj"], ("shared", 0))
    layer.load_w13(layer.w13, shared["up_proj"], ("shared", 1))
    layer.load_w2(layer.w2, shared["down_proj"], "shared")
    return layer


def test_shared_experts_in_the_grouped_weights_equal_the_shared_mlp() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    mlp = GatedMLP(HIDDEN, SHARED * INTER, "silu", ParallelContext())
    shared = shared_checkpoint()
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, shared["gate_proj"], 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, shared["up_proj"], 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, shared["down_proj"])
    want = build(ParallelContext())(x, weights, ids) + mlp(x)
    layer = build_with_shared(ParallelContext())
    got = layer(x, *with_shared_experts(weights, ids, E, SHARED))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # tensor parallel: each rank holds its slice of every shared expert's width, the parts sum to the whole
    ranks = [build_with_shared(ParallelContext(r, 2)) for r in range(2)]
    total = sum(rank(x, *with_shared_experts(weights, ids, E, SHARED)) for rank in ranks)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_a_shared_mlp_of_the_wrong_width_is_a_shape_error() -> None:
    layer = FusedExperts(E, HIDDEN, INTER, "silu", ParallelContext(), num_shared=SHARED)
    with pytest.raises(ShapeMismatch, match="n_shared_experts x moe_intermediate_size"):
        layer.load_w13(layer.w13, torch.zeros(3 * INTER, HIDDEN), ("shared", 0))
    with pytest.raises(ValueError, match="expert parallelism"):
        FusedExperts(E, HIDDEN, INTER, "silu", ParallelContext(0, 2, expert_parallel=True), num_shared=1)
