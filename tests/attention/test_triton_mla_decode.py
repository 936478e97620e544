"""The Triton MLA decode kernel against the torch reference, under TRITON_INTERPRET=1 on CPU (tiny sizes)."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.metadata import build_metadata  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.attention.triton import mla_decode as kernel_module  # noqa: E402
from mlaserve.attention.triton.mla_decode import mla_decode  # noqa: E402

LAT, ROPE = 32, 16
# The merge at the end of the attention launch (arrival counters), and the two-launch merge it replaced.
MERGES = ["fused", "stage2"]


def random_case(seq_lens, heads, page, seed, num_blocks=48):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, page, 1, LAT + ROPE, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(-(-n // page) for n in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            table[i, j] = free.pop()
    q = torch.randn(len(seq_lens), heads, LAT + ROPE, generator=gen)
    meta = build_metadata(
        page, table, [1] * len(seq_lens), list(seq_lens), len(seq_lens), torch.zeros(0, dtype=torch.long)
    )
    return q, cache, table, meta


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("seq_lens, heads, page, splits", [
    ([1, 7, 33, 64], 4, 16, 1),  # one split: written straight to the output when fused
    ([9, 40, 3], 20, 16, 1),  # one split, a head group with masked heads
    ([5, 70, 18], 16, 16, 3),
    ([100, 1, 40], 20, 32, 4),  # heads beyond one group of 16, a split that is empty for short sequences
    ([3, 1, 200, 17], 16, 16, 16),  # many splits, most of them empty except for the long sequence
])  # fmt: skip
def test_matches_reference(seq_lens, heads, page, splits, merge):
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=len(seq_lens) + heads)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=16, num_splits=splits, merge=merge
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_backend_runs_a_tiny_deepseek_like_the_reference(tmp_path, name):
    from mlaserve import LLM, SamplingParams
    from tests.tiny_models import build_tiny

    path = build_tiny(name, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 9, 11, 40, 7]}, {"prompt_token_ids": [3] * 19}]
    outs = {}
    for backend in ("torch", "triton_mla"):
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, attention_backend=backend)
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for ref, got in zip(outs["torch"], outs["triton_mla"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, have, tok in zip(
            ref.outputs[0].logprobs, got.outputs[0].logprobs, ref.outputs[0].token_ids
        ):
            assert abs(want[tok] - have[tok]) < 1e-4


def test_selector_refuses_triton_without_gpu_or_interpreter(monkeypatch):
    from mlaserve.attention.selector import select_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton_mla.*CUDA GPU"):
        select_backend(torch.device("cpu"), "triton_mla")


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("block_n", [16, 32])  # 32 spans two pages of 16: the row-by-row lookup path
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_matches_reference_on_the_same_rows(kv_dtype, block_n, merge):
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    dtype = QUANTIZED[kv_dtype]
    seq_lens, heads, page = [9, 40, 3], 16, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=7)
    rows = quantize_rows(cache.view(-1, LAT + ROPE), dtype).view(*cache.shape[:3], LAT + ROPE + 16)
    want, want_lse = TorchBackend().decode(q, rows, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode(
        q, rows, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=block_n, num_splits=2, merge=merge
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("page, block_n", [(16, 16), (32, 16), (16, 32)])
def test_tiles_inside_or_across_pages(page, block_n, prefetch, merge):
    """block_n dividing the page takes the one-lookup tile path; a tile spanning pages looks rows up one by one."""
    seq_lens, heads = [5, 70, 33], 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=page + block_n)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode(
        q,
        cache,
        table,
        meta.seq_lens,
        max(seq_lens),
        LAT,
        0.2,
        block_n=block_n,
        num_splits=3,
        prefetch=prefetch,
        merge=merge,
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_fp16_dots_and_bf16_partials_stay_close(kv_dtype, merge):
    """The speed options: 8-bit tiles widened to fp16 for the dots, partial outputs stored in bf16."""
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    seq_lens, heads, page = [9, 70, 3], 16, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=11)
    q = q.bfloat16()
    rows = quantize_rows(cache.view(-1, LAT + ROPE), QUANTIZED[kv_dtype]).view(
        *cache.shape[:3], LAT + ROPE + 16
    )
    want, want_lse = TorchBackend().decode(q, rows, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode(
        q, rows, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=16, num_splits=3,
        partial_dtype=torch.bfloat16, q_f16=True, merge=merge,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


def test_fused_merge_agrees_with_two_launches_and_leaves_the_counters_at_zero():
    """Run twice on the same inputs: the second call finds the counters the first one reset, so it merges (not a
    split early or never) and gives the same bits; the split query (q_pe) goes through the same path."""
    seq_lens, heads, page = [5, 70, 18, 33], 20, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=3)
    args = (q[..., :LAT], cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2)
    kw = dict(block_n=16, num_splits=5, q_pe=q[..., LAT:])
    first = mla_decode(*args, **kw)
    counters = kernel_module._arrivals[q.device]
    assert counters.count_nonzero() == 0
    second = mla_decode(*args, **kw)
    assert counters.count_nonzero() == 0
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    two_launches = mla_decode(*args, **kw, merge="stage2")
    for a, b in zip(first, two_launches):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class CountLaunches:
    """Stands in for a kernel (kernel[grid](...)) and counts its launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("slots, splits, merge, launches", [
    (1 << 16, 3, "fused", 0),
    (1 << 16, 1, "fused", 0),
    (1 << 16, 1, "stage2", 1),  # the two-launch path stays as it was, one split included
    (4, 3, "fused", 1),  # 3 sequences x 2 head groups do not fit 4 counters: two launches
    (1 << 16, 65, "fused", 1),  # more splits than the fused merge's LSE tile
])  # fmt: skip
def test_merge_launches_stage2_only_when_asked_or_needed(monkeypatch, slots, splits, merge, launches):
    seq_lens, heads, page = [9, 300, 3], 20, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=5)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    stage2 = CountLaunches(kernel_module._stage2)
    monkeypatch.setattr(kernel_module, "_stage2", stage2)
    monkeypatch.setattr(kernel_module, "ARRIVAL_SLOTS", slots)
    got, lse = mla_decode(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_h=16, block_n=16, num_splits=splits,
        merge=merge,
    )  # fmt: skip
    assert stage2.launches == launches
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_fused_merge_in_column_slices(monkeypatch):
    """Bigger head groups merge the latent columns a slice at a time; here 32 heads x 16 of 32 columns."""
    monkeypatch.setattr(kernel_module, "MERGE_TILE", 32 * 16)
    seq_lens, heads, page = [40, 7, 90], 20, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=9)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_h=32, block_n=16, num_splits=4
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("splits", [1, 3])
def test_empty_sequence_gives_zero_and_minus_infinity(splits, merge):
    """A row of length 0 has no token in any split: output 0 and LSE -inf (what a merge with other partial
    results expects), not NaN; the rows beside it are unaffected."""
    seq_lens, heads, page = [20, 1], 4, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=2)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    lens = torch.tensor([20, 0], dtype=torch.int32)
    got, lse = mla_decode(q, cache, table, lens, 20, LAT, 0.2, block_n=16, num_splits=splits, merge=merge)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.isneginf(lse[1]).all()
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[0], want_lse[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "batch, max_len, want",
    [(64, 4096, 4), (128, 8192, 2), (1, 576, 3), (1, 10240, 40), (32, 4096, 8)],
)
def test_split_rule(batch, max_len, want):
    from mlaserve.attention.triton.mla_decode import num_splits_for

    assert num_splits_for(batch, 1, max_len, 64, 132, 16) == want
