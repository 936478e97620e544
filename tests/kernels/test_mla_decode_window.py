"""The paged decode kernel's window (mla_decode's `window`: each sequence's last rows only, read through its table
from the tile the window starts in) against the same rows gathered and attended in torch, with every block before
a window freed to a block full of NaN, as a sliding-window group's table leaves them. Twin test: the interpreter on
CPU, natively on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.mla_decode import decode, dispatch  # noqa: E402
from mlaserve.kernels.mla_decode.reference import paged_latent_decode  # noqa: E402
from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeDevice  # noqa: E402

LAT, HEADS, WINDOW = 32, 4, 12


def windowed_case(seq_lens: list[int], page: int, device: str):
    """Caches whose blocks before each window are the null block 0, full of NaN."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + page)
    width = max(-(-n // page) for n in seq_lens)
    blocks = len(seq_lens) * width + 1
    cache = torch.randn(blocks, page, 1, LAT, generator=gen)
    cache[0] = float("nan")
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    free = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    for i, n in enumerate(seq_lens):
        for j in range(max(n - WINDOW, 0) // page, -(-n // page)):
            table[i, j] = free.pop()
    q = torch.randn(len(seq_lens), HEADS, LAT, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(device), cache.to(device), table.to(device), lens.to(device)


def gathered_attention(q, cache, table, seq_lens, scale):
    """Each sequence's last WINDOW rows gathered by position, one softmax: (out, lse)."""
    outs, lses = [], []
    page = cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(max(n - WINDOW, 0), n, device=q.device)
        rows = cache.view(-1, LAT)[table[i].long()[pos // page] * page + pos % page].float()
        s = q[i].float() @ rows.T * scale
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1) @ rows)
    return torch.stack(outs), torch.stack(lses)


CASES = [([1, 5, 12, 13, 30, 47], 8), ([3, 12, 29], 4), ([20, 64, 9], 16)]


@pytest.mark.parametrize("seq_lens, page", CASES)
def test_window_equals_the_gathered_rows(seq_lens, page, device):
    q, cache, table, lens = windowed_case(seq_lens, page, device)
    want, want_lse = gathered_attention(q, cache, table, lens, 0.3)
    got, lse = decode.mla_decode(q, cache, table, lens, WINDOW, LAT, 0.3, window=WINDOW)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)
    ref, ref_lse = paged_latent_decode(q, q[..., :0], cache, table, lens, LAT, 0.3, WINDOW)
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref_lse, want_lse, atol=2e-5, rtol=2e-5)


# The tile loop's three forms (prefetch, the page looked up ahead, neither), tiles inside pages and across them,
# and several splits over a window
@pytest.mark.parametrize(
    "tuning",
    [
        {"prefetch": True, "block_n": 16},
        {"prefetch": False, "page_ahead": True, "block_n": 16},
        {"prefetch": False, "page_ahead": False, "block_n": 32, "num_splits": 3},
        {"block_n": 16, "num_splits": 2},
    ],
)
def test_every_tile_loop_reads_the_window(tuning, device):
    q, cache, table, lens = windowed_case([1, 17, 40, 16, 33], 16, device)
    want, want_lse = gathered_attention(q, cache, table, lens, 0.3)
    shape, call, dev = decode.describe_call(q, cache, WINDOW, LAT, 0, WINDOW)
    plan = dispatch.plan_for(dispatch.KERNELS_BY_NAME["triton"], shape, call, dev, tuning)
    assert plan.window == WINDOW and not plan.balanced
    got, lse = decode.launch(plan, q, q[..., :0], cache, table, lens, LAT, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_kernels_without_a_window_are_refused_for_it():
    # DeepSeek's 16-bit latent rows on Hopper: the 64-head Gluon kernel takes the call, but not with a window
    q, cache = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)
    shape, _, _ = decode.describe_call(q, cache, 128, 512, 64)
    hopper = DecodeDevice("sm_90", 132, True, True)
    gluon = dispatch.KERNELS_BY_NAME["gluon_wgmma"]
    assert dispatch.refusal(gluon, shape, DecodeCall(32, 65536), hopper) is None
    assert dispatch.refusal(gluon, shape, DecodeCall(32, 128, window=128), hopper) is not None
    assert dispatch.choose_kernel(shape, DecodeCall(32, 65536), hopper).name == "gluon_wgmma"
    assert dispatch.choose_kernel(shape, DecodeCall(32, 128, window=128), hopper).name == "triton"
