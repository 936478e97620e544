"""The fused (sorted, grouped-GEMM) MoE against the per-expert reference loop, under TRITON_INTERPRET=1."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mlaserve.layers.fused_moe import fused_experts, sort_by_expert, sort_by_expert_reference  # noqa: E402
from mlaserve.layers.moe import experts_reference  # noqa: E402


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [(5, 8, 2, 32, 16), (19, 6, 3, 48, 40), (1, 4, 1, 16, 16), (40, 4, 2, 32, 16)],  # the last: 64-row tiles
)
def test_fused_matches_reference(tokens, experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    want = experts_reference(x, w13, w2, weights, ids, F.silu)
    got = fused_experts(x, w13, w2, weights, ids, F.silu)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sort_by_expert_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, tile_expert = sort_by_expert(ids, num_experts=4, block_m=4)
    sentinel = ids.numel()
    assert tile_expert.tolist()[:3] == [0, 1, 2] and all(e == -1 for e in tile_expert.tolist()[3:])
    tiles = sorted_ids.view(-1, 4).tolist()
    assert sorted(t for t in tiles[0] if t != sentinel) == [1, 4]  # expert 0: pairs (0,1) and (2,0)
    assert [t for t in tiles[1] if t != sentinel] == [3]
    assert sorted(t for t in tiles[2] if t != sentinel) == [0, 2, 5]


@pytest.mark.parametrize(
    "tokens, experts, top_k, block_m",
    # the last: DeepSeek-V3's 256 experts x top-8, 4,208 slots in 1,052 tiles (both chunked loops repeat)
    [(1, 64, 6, 16), (7, 8, 2, 4), (33, 6, 3, 16), (5, 160, 8, 16), (40, 4, 2, 64), (430, 256, 8, 4)],
)
def test_one_launch_sort_equals_the_torch_version(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    got = sort_by_expert(ids, experts, block_m)
    want = sort_by_expert_reference(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
