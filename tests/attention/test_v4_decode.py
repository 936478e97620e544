"""DeepSeek-V4's decode attention on the Triton kernels (attention/v4_decode.py) against V4Attention's torch decode,
on random caches through shuffled block tables: a sliding layer, a 4:1 layer with its indexer, a 128:1 layer, with
contexts shorter than the window, at entry boundaries, batched with mixed lengths, and at a captured step's widths
(the host's lengths all max_model_len). Twin test: the interpreter on CPU at tiny sizes, natively on a GPU."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.metadata import AttentionMetadata  # noqa: E402
from mlaserve.attention.v4_decode import decode_on_kernels  # noqa: E402
from mlaserve.kvcache import segments  # noqa: E402
from mlaserve.models.deepseek_v4 import HEAVY, SLIDING, SPARSE, V4Attention  # noqa: E402
from mlaserve.testing.device import kernel_test_dtypes  # noqa: E402

HEADS, DIM, PAGE, WINDOW = 4, 32, 4, 8
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def config(kind: str, rate: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=HEADS, head_dim=DIM, sliding_window=WINDOW, o_groups=2, o_lora_rank=8,
        rms_norm_eps=1e-6, hidden_size=24, q_lora_rank=16, qk_rope_head_dim=16,
        rope_parameters={"main": ROPE, "compress": ROPE}, compress_rates={kind: rate}, layer_types=[kind],
        index_n_heads=16, index_head_dim=16, index_topk=4,
    )  # fmt: skip


def shuffled_tables(counts: list[int], width: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Tables [B, width] of distinct shuffled blocks (1..) holding each sequence's `counts` rows; block 0 (null)
    pads them. Returns the tables and the blocks a cache needs."""
    need = [-(-n // PAGE) for n in counts]
    free = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    tables = torch.zeros(len(counts), width, dtype=torch.int32)
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(free[:k], dtype=torch.int32)
        free = free[k:]
    return tables, sum(need) + 1


def metadata(tables: torch.Tensor, lens: list[int], host: list[int]) -> AttentionMetadata:
    b = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=tables.device)
    empty = torch.zeros(0, dtype=torch.long, device=tables.device)
    return AttentionMetadata(PAGE, empty, seq_lens, tables, b, [1] * b, host)


def as_cache(values: torch.Tensor, parts: tuple[int, ...], cache_dtype: torch.dtype | None) -> torch.Tensor:
    """Random rows as a cache of cache_dtype stores them (None: as they are), each part scaled on its own."""
    if cache_dtype is None:
        return values
    return segments.pack(values.split(parts, dim=-1), cache_dtype)


def run_both(
    kind: str,
    rate: int,
    lens: list[int],
    dtype: torch.dtype,
    device: str,
    max_model_len: int = 0,
    cache_dtype: torch.dtype | None = None,
):
    """(kernels, torch) outputs of one decode step of random queries over random caches (8-bit with
    cache_dtype)."""
    gen = torch.Generator().manual_seed(sum(lens) + rate)
    torch.manual_seed(len(lens))
    attn = V4Attention(config(kind, rate), kind)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    attn = attn.to(device, dtype)
    host = [max_model_len] * len(lens) if max_model_len else lens
    tables, blocks = shuffled_tables(lens, -(-max(host) // PAGE), gen)
    rows = as_cache(torch.randn(blocks * PAGE, attn.row_width, generator=gen), attn.row_parts, cache_dtype)
    rows = rows.to(device, cache_dtype or dtype)
    meta = metadata(tables.to(device), lens, host)
    entries = stored = None
    if kind != SLIDING:
        counts = [n // rate for n in lens]
        entry_tables, entry_blocks = shuffled_tables(counts, max(1, -(-(max(host) // rate) // PAGE)), gen)
        stored = torch.randn(entry_blocks * PAGE, attn.entry_width, generator=gen)
        stored = as_cache(stored, attn.entry_parts, cache_dtype).to(device, cache_dtype or dtype)
        entries = metadata(entry_tables.to(device), lens, host)
    b = len(lens)
    q = torch.randn(b, HEADS, DIM, generator=gen).to(device, dtype)
    q_resid = torch.randn(b, 16, generator=gen).to(device, dtype)
    hidden = torch.randn(b, 24, generator=gen).to(device, dtype)
    positions = torch.tensor(lens, device=device) - 1
    args = (q, q_resid, hidden, positions, rows, meta, entries, stored)
    with torch.no_grad():
        return decode_on_kernels(attn, *args), attn._decode(*args)


CASES = [
    (SLIDING, 1, [1, 3, 8, 9, 21]),  # shorter than the window, the window exactly, past it
    (SPARSE, 4, [1, 3, 4, 5, 8, 17, 33, 40]),  # no entry yet, the first, fewer than top-k, more
    (HEAVY, 128, [1, 9, 127, 128, 129, 300]),  # the entry boundaries of 128:1
    (HEAVY, 8, [7, 8, 16, 23]),
]


@pytest.mark.parametrize("dtype", kernel_test_dtypes(), ids=str)
@pytest.mark.parametrize("kind, rate, lens", CASES, ids=lambda c: str(c))
def test_kernels_equal_the_torch_decode(kind, rate, lens, dtype, device):
    got, want = run_both(kind, rate, lens, dtype, device)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2}.get(dtype, 4e-2)  # bf16 on a GPU: 8 bits of mantissa
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind, rate", [(SLIDING, 1), (SPARSE, 4), (HEAVY, 8)])
def test_a_captured_steps_widths_give_the_same_output(kind, rate, device):
    # The host's lengths all max_model_len, as a captured step's metadata has them: the widths grow, not the keys.
    got, want = run_both(kind, rate, [2, 9, 30], torch.float32, device, max_model_len=64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8], ids=str)
@pytest.mark.parametrize("kind, rate, lens", CASES[:3], ids=lambda c: str(c))
def test_kernels_read_8bit_parts_as_the_torch_decode_does(kind, rate, lens, cache_dtype, device):
    # Both read the same 8-bit rows: the kernels widen each part's values and apply its scale from the tail after
    # them (the window's kv, the entries' kv, the indexer keys), the torch decode dequantizes the part first.
    got, want = run_both(kind, rate, lens, torch.float32, device, cache_dtype=cache_dtype)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
