"""On a GPU (skipped in CI): the MLA decode kernel's fused split merge (the last split to finish merges, counted
with atomics) against the two-launch merge, eagerly and over many CUDA-graph replays. The interpreter runs programs
one after another, so only real hardware shows a merge reading a partial that has not landed, or a counter left
non-zero for the next call."""

import pytest
import torch

from mlaserve.attention.triton.mla_decode import mla_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAT, ROPE, PAGE = 512, 64, 64


def case(seq_lens: list[int], heads: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // PAGE) for n in seq_lens)
    blocks = torch.randperm(len(seq_lens) * width + 1, generator=gen)[: len(seq_lens) * width] + 1
    cache = torch.randn(len(seq_lens) * width + 2, PAGE, 1, LAT + ROPE, generator=gen).to(torch.bfloat16)
    table = blocks.view(len(seq_lens), width).to(torch.int32)
    q = torch.randn(len(seq_lens), heads, LAT + ROPE, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.cuda(), cache.cuda(), table.cuda(), lens.cuda(), max(seq_lens)


@pytest.mark.parametrize(
    "seq_lens, heads, splits",
    [
        ([4096] * 64, 16, None),
        ([1, 700, 4096, 63, 2048] * 3, 16, 16),
        ([9000], 16, 64),
        ([300, 5000] * 4, 128, 8),
    ],
)
def test_fused_merge_matches_two_launches_and_resets(seq_lens, heads, splits):
    q, cache, table, lens, longest = case(seq_lens, heads, seed=len(seq_lens) + heads)
    args = (q, cache, table, lens, longest, LAT, 0.07)
    want, want_lse = mla_decode(*args, num_splits=splits, merge="stage2")
    first, first_lse = mla_decode(*args, num_splits=splits)
    torch.testing.assert_close(first.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first_lse, want_lse, atol=1e-4, rtol=1e-5)
    for _ in range(20):  # whichever program arrives last, the merge is the same arithmetic: the same bits
        out, lse = mla_decode(*args, num_splits=splits)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_fused_merge_in_a_cuda_graph_follows_new_inputs():
    q, cache, table, lens, longest = case([3000, 17, 4096, 1200], 16, seed=5)
    static_q = q.clone()
    mla_decode(static_q, cache, table, lens, 4096, LAT, 0.07)  # allocates the counters outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_decode(static_q, cache, table, lens, 4096, LAT, 0.07)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = mla_decode(static_q, cache, table, lens, 4096, LAT, 0.07)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(30):
        static_q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype))
        graph.replay()
        want, _ = mla_decode(static_q, cache, table, lens, 4096, LAT, 0.07, merge="stage2")
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
