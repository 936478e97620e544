"""kernels/v4_parts.py against the torch forms they replace (attention/v4_decode.py's merge_with_sink): one part
and two, parts with no keys whose outputs are NaN; the entries' counts. Twin test: the interpreter on CPU, natively
on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.v4_decode import Part, merge_with_sink  # noqa: E402
from mlaserve.kernels import v4_parts  # noqa: E402


def test_entry_rows_count_each_sequences_complete_entries(device):
    lens = torch.tensor([0, 1, 3, 4, 9, 23], dtype=torch.int32, device=device)
    got = v4_parts.entry_rows(lens, 4)
    assert torch.equal(got.counts, lens // 4)
    assert torch.equal(got.rows, torch.arange(6, dtype=torch.int32, device=device))


@pytest.mark.parametrize("two", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_merge_with_sink_equals_the_torch_merge(two, dtype, device):
    gen = torch.Generator().manual_seed(1)
    b, h, d = 5, 3, 24  # d not a power of two: the tile is masked

    def part(lens: list[int]) -> Part:
        out = torch.randn(b, h, d, generator=gen).to(device, dtype)
        lse = torch.randn(b, h, generator=gen).to(device)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        empty = lens_t == 0
        out[empty], lse[empty] = float("nan"), float("nan")  # the kernels leave a part with no keys undefined
        return Part(out, lse, lens_t)

    parts = [part([0, 1, 3, 0, 2])] + ([part([0, 0, 5, 1, 7])] if two else [])
    sink = torch.randn(h, generator=gen).to(device)
    got = v4_parts.merge_with_sink(parts, sink, dtype)
    want = merge_with_sink(parts, sink).to(dtype)
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
