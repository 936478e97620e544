"""DeepSeek-V4's prefill attention on the Triton kernels (attention/v4_prefill.py) against V4Attention's torch
prefill, on random caches through shuffled block tables: prefills that start from nothing and ones that continue a
context (a chunk, a prefix hit), shorter and longer than the window, across entry boundaries, behind a decode row,
on 32-bit and 8-bit caches. Twin test: the interpreter on CPU at tiny sizes, natively on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.metadata import AttentionMetadata  # noqa: E402
from mlaserve.attention.v4_prefill import prefill_on_kernels  # noqa: E402
from mlaserve.models.deepseek_v4 import HEAVY, SLIDING, SPARSE, V4Attention  # noqa: E402
from tests.attention.test_v4_decode import DIM, HEADS, PAGE, as_cache, config, shuffled_tables  # noqa: E402


def run_both(kind: str, rate: int, seqs: list[tuple[int, int]], device: str, cache_dtype=None):
    """(kernels, torch) outputs for the prefill tokens of one step: seqs are (context after the step, query
    tokens), the first a decode row (one query token) whose output neither computes."""
    gen = torch.Generator().manual_seed(sum(n for n, _ in seqs) + rate)
    torch.manual_seed(len(seqs))
    attn = V4Attention(config(kind, rate), kind)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    attn = attn.to(device)
    lens, query_lens = [n for n, _ in seqs], [q for _, q in seqs]
    tables, blocks = shuffled_tables(lens, -(-max(lens) // PAGE), gen)
    rows = as_cache(torch.randn(blocks * PAGE, attn.row_width, generator=gen), attn.row_parts, cache_dtype)

    def meta(tables: torch.Tensor) -> AttentionMetadata:
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return AttentionMetadata(PAGE, empty, seq_lens, tables.to(device), 1, query_lens, lens)

    entries = stored = None
    if kind != SLIDING:
        counts = [n // rate for n in lens]
        entry_tables, entry_blocks = shuffled_tables(counts, max(1, -(-(max(lens) // rate) // PAGE)), gen)
        stored = torch.randn(entry_blocks * PAGE, attn.entry_width, generator=gen)
        stored = as_cache(stored, attn.entry_parts, cache_dtype).to(device)
        entries = meta(entry_tables)
    positions = torch.cat([torch.arange(n - q, n) for n, q in seqs[1:]]).to(device)
    t = positions.shape[0]
    q = torch.randn(t, HEADS, DIM, generator=gen).to(device)
    q_resid, hidden = (
        torch.randn(t, 16, generator=gen).to(device),
        torch.randn(t, 24, generator=gen).to(device),
    )
    args = (q, q_resid, hidden, positions, rows.to(device), meta(tables), entries, stored)
    with torch.no_grad():
        return prefill_on_kernels(attn, *args), attn._prefill(*args)


CASES = [
    (SLIDING, 1, [(5, 1), (6, 6), (30, 30), (40, 7)]),  # from nothing, past the window, continuing a context
    (
        SPARSE,
        4,
        [(9, 1), (3, 3), (37, 37), (45, 12), (23, 1)],
    ),  # entries completed inside the chunk, top-k of more
    (HEAVY, 8, [(9, 1), (17, 17), (40, 9), (64, 30)]),
]


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["float32", "fp8"])
@pytest.mark.parametrize("kind, rate, seqs", CASES, ids=lambda c: str(c))
def test_kernels_equal_the_torch_prefill(kind, rate, seqs, cache_dtype, device):
    got, want = run_both(kind, rate, seqs, device, cache_dtype)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
