"""The varlen prefill attention kernel against its torch reference: under TRITON_INTERPRET=1 on CPU at tiny sizes,
natively on a GPU (twin tests). Uneven sequences, chunks over a cached prefix, single queries, windows, odd and
grouped head counts, DeepSeek's 192/128 widths and widths that are not powers of two."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.metadata import build_metadata  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.kernels.prefill_attn.reference import prefill_attention_reference  # noqa: E402
from mlaserve.kernels.prefill_attn.tiles import DEFAULT_TILE, PrefillTile  # noqa: E402
from mlaserve.kernels.prefill_attn.triton_prefill import (  # noqa: E402
    prefill_attention,
    prefill_attention_tiled,
    tile_facts,
    tile_map,
)
from mlaserve.testing.device import kernel_test_dtypes, on_gpu  # noqa: E402

SMALL = PrefillTile(16, 16, 4, 1)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def offsets(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def random_case(query_lens, kv_lens, heads, kv_heads, dk, dv, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lens), heads, dk, generator=gen).to(device, dtype)
    k = torch.randn(sum(kv_lens), kv_heads, dk, generator=gen).to(device, dtype)
    v = torch.randn(sum(kv_lens), kv_heads, dv, generator=gen).to(device, dtype)
    return q, k, v, offsets(query_lens, device), offsets(kv_lens, device)


def check(got, want, dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


CASES = [
    # (query lens, key lens: a chunk over a cached prefix has more keys than queries), heads, kv heads, dk, dv
    ([5, 1, 19, 16], [5, 9, 40, 16], 3, 3, 192, 128),  # DeepSeek's widths; a single query over a prefix
    ([33, 0, 7], [33, 0, 50], 5, 5, 24, 16),  # an empty sequence (a padded graph's), widths not powers of two
    ([1, 1], [1, 30], 6, 2, 96, 64),  # grouped heads, queries of one
    ([40], [40], 1, 1, 8, 8),  # one head narrower than a dot: padded to 16
]


@pytest.mark.parametrize("dtype", kernel_test_dtypes())
@pytest.mark.parametrize("window", [None, 1, 7, 100])
@pytest.mark.parametrize("query_lens, kv_lens, heads, kv_heads, dk, dv", CASES)
def test_matches_reference(query_lens, kv_lens, heads, kv_heads, dk, dv, window, dtype, device):
    seed = sum(query_lens) + heads + dk + (window or 0)
    q, k, v, cu_q, cu_k = random_case(query_lens, kv_lens, heads, kv_heads, dk, dv, dtype, device, seed)
    want, want_lse = prefill_attention_reference(q, k, v, cu_q, cu_k, 0.3, window, return_lse=True)
    got, lse = prefill_attention_tiled(q, k, v, cu_q, cu_k, 0.3, window, return_lse=True, tile=SMALL)
    assert got.dtype == dtype and got.shape == (q.shape[0], heads, dv)
    check(got, want, dtype)
    check(lse, want_lse, torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize(
    "tile",
    [None, DEFAULT_TILE, PrefillTile(64, 32, 4, 2), PrefillTile(32, 64, 4, 1), PrefillTile(16, 32, 4, 2)],
)
def test_tiles_agree(tile, device):
    """The default tile's ladder (tile None, in float32: a rung below the default) and other tiles in 16 bits (a
    GPU has the shared memory for them), the default among them, with tiles that straddle the diagonal unevenly."""
    query_lens, kv_lens = [70, 3, 129], [70, 90, 200]
    dtype = torch.float32 if tile is None else torch.float16
    q, k, v, cu_q, cu_k = random_case(query_lens, kv_lens, 2, 2, 192, 128, dtype, device, 7)
    for window in (None, 45):
        want = prefill_attention_reference(q, k, v, cu_q, cu_k, 0.1, window)[0]
        got, lse = prefill_attention_tiled(q, k, v, cu_q, cu_k, 0.1, window, tile=tile)
        assert lse is None
        check(got, want, dtype)


def test_matches_the_torch_backend_on_engine_metadata(device):
    """Through the metadata the runner builds: chunks after earlier chunks, and a window's gathered context
    (its context starts: keys before them are gathered no more)."""
    query_lens, seq_lens = [4, 30, 1, 17], [4, 62, 20, 17]
    table = torch.arange(20, dtype=torch.int32, device=device).view(4, 5)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    for window in (None, 9):
        meta = build_metadata(16, table, query_lens, seq_lens, 0, slots, window=window)
        kv_lens = meta.prefill_seq_lens
        q, k, v, _, _ = random_case(query_lens, kv_lens, 4, 4, 192, 128, torch.float32, device, len(kv_lens))
        want = TorchBackend().prefill(q, k, v, meta, 0.2)
        got = prefill_attention(q, k, v, meta.prefill_cu_query_lens, meta.prefill_cu_seq_lens, 0.2, window)[0]
        check(got, want, torch.float32)


def test_tile_map_lists_every_tile_once_heaviest_first(device):
    cu_q = offsets([33, 0, 16, 1], device)
    seq, start = tile_map(cu_q, 50, 16)
    # 3 + 0 + 1 + 1 tiles, the last sequence's first; then -1 up to 50 // 16 + 4 programs
    assert seq.tolist() == [3, 2, 0, 0, 0, -1, -1]
    assert start.tolist() == [0, 0, 32, 16, 0, 0, 0]
    assert seq.dtype == start.dtype == torch.int32


def test_tile_facts_need_a_compiled_kernel():
    """Under the interpreter nothing is compiled: no registers to report (tests/gpu checks them on a GPU)."""
    if on_gpu():
        pytest.skip("tests/gpu/test_prefill128_on_gpu.py reads them on a GPU")
    q, k, v, cu_q, cu_k = random_case([3], [3], 1, 1, 16, 16, torch.float32, "cpu", 0)
    assert tile_facts(q, k, v, cu_q, cu_k, SMALL) == {}


def test_no_queries():
    q, k, v = torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), torch.zeros(0, 2, 8)
    cu = torch.zeros(2, dtype=torch.int32)
    out, lse = prefill_attention(q, k, v, cu, cu, 1.0, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((4, 2, 16), (4, 2, 24), (4, 2, 8)), "takes q"),  # q and k of different widths
        (((4, 3, 16), (4, 2, 16), (4, 2, 8)), "multiple of K/V heads"),
    ],
)
def test_refuses_bad_shapes(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        prefill_attention(q, k, v, cu, cu, 1.0)
