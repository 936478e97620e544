"""The Triton MLA decode kernel against the torch reference, under TRITON_INTERPRET=1 on CPU (tiny sizes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mlaserve.attention.metadata import build_metadata  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.kernels.mla_decode import widen  # noqa: E402
from mlaserve.kernels.mla_decode.decode import mla_decode  # noqa: E402
from mlaserve.kernels.mla_decode.spans import split_span  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402

LAT, ROPE = 32, 16


@triton.jit
def _widen_kernel(X, Y, N: tl.constexpr):
    tl.store(Y + tl.arange(0, N), widen.widen_bits(tl.load(X + tl.arange(0, N)), tl.float16))


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


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("seq_lens, heads, page, splits", [
    ([1, 7, 33, 64], 4, 16, 1),
    ([5, 70, 18], 16, 16, 3),
    ([100, 1, 40], 20, 32, 4),  # heads beyond one group of 16, a split that is empty for short sequences
])  # fmt: skip
def test_matches_reference(seq_lens, heads, page, splits, balanced):
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=len(seq_lens) + heads)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode_tuned(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=16, num_splits=splits,
        balanced=balanced, min_span_rows=16,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seq_lens, programs, min_rows", [
    ([300, 0, 7, 129, 1, 0, 64], 3, 16),  # sequences of no rows; spans that end inside a sequence
    ([500] + [3] * 20, 8, 16),  # one long sequence over most programs, many short ones in one program
    ([17] * 5, 64, 16),  # more programs than tiles: most take none
    ([200, 40, 90], 4, 64),  # the least span (4 tiles) leaves programs idle
    ([0, 0, 5], 4, 16),  # sequences of no rows first
])  # fmt: skip
def test_balanced_spans_match_reference(seq_lens, programs, min_rows):
    """Balanced spans (each program an equal run of the batch's tiles, over as many sequences as it touches) give
    the reference's outputs and LSEs whatever the lengths."""
    q, cache, table, meta = random_case(seq_lens, 16, 16, seed=programs, num_blocks=64)
    got, lse = mla_decode_tuned(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=16, num_splits=programs,
        balanced=True, min_span_rows=min_rows,
    )  # fmt: skip
    live = torch.tensor(seq_lens) > 0  # a sequence of no rows: zero output, LSE -inf
    assert (got[~live] == 0).all() and (lse[~live] == float("-inf")).all()
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    torch.testing.assert_close(got[live], want[live], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[live], want_lse[live], atol=2e-5, rtol=2e-5)


def test_balanced_spans_past_512_sequences():
    """The lengths are summed 512 at a time: a batch past that still finds each program's first sequence."""
    seq_lens = [(7 * i) % 5 for i in range(520)]  # 0 to 4 rows, some sequences empty
    q, cache, table, meta = random_case(seq_lens, 1, 16, seed=520, num_blocks=600)
    got, lse = mla_decode_tuned(
        q,
        cache,
        table,
        meta.seq_lens,
        16,
        LAT,
        0.2,
        block_n=16,
        num_splits=7,
        balanced=True,
        min_span_rows=16,
    )
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    live = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(got[live], want[live], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[live], want_lse[live], atol=2e-5, rtol=2e-5)


@triton.jit
def _spans_kernel(SeqLens, Out, num_splits, split_target, BLOCK_N: tl.constexpr):
    b, split = tl.program_id(0), tl.program_id(2)
    start, end, _ = split_span(SeqLens, b, split, num_splits, split_target, 0, BLOCK_N)
    tl.store(Out + (b * num_splits + split) * 2, start)
    tl.store(Out + (b * num_splits + split) * 2 + 1, end)


def split_spans(
    lens: list[int], num_splits: int, target: int, block_n: int = 16
) -> list[list[tuple[int, int]]]:
    """Each sequence's non-empty (start, end) slices as the decode kernels cut them."""
    out = torch.zeros(len(lens), num_splits, 2, dtype=torch.int32)
    _spans_kernel[(len(lens), 1, num_splits)](
        torch.tensor(lens, dtype=torch.int32), out, num_splits, target, BLOCK_N=block_n
    )
    return [[(s, e) for s, e in row.tolist() if s < e] for row in out]


@settings(max_examples=25, deadline=None, database=None)
@given(
    lens=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    target=st.integers(1, 8),
    room=st.integers(1, 4),
)
def test_splits_cover_each_sequence_by_its_share(lens, target, room):
    """Every sequence's slices tile its rows in order, in whole tiles but the last, at most the grid's count; equal
    lengths (in whole tiles per slice) take the target count each."""
    grid = target * room
    for n, slices in zip(lens, split_spans(lens, grid, target), strict=True):
        assert slices[0][0] == 0 and slices[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        assert all((e - s) % 16 == 0 for s, e in slices[:-1])
        assert 1 <= len(slices) <= grid
    length = 16 * target * (lens[0] % 8 + 1)
    assert [len(s) for s in split_spans([length] * 3, grid, target)] == [target] * 3


def test_a_long_sequence_takes_more_slices_than_the_short_ones():
    """The mixed workload's case: one sequence far longer than the rest takes room x target slices, the rest one."""
    spans = split_spans([4000] + [500] * 15, 4, 1, block_n=64)
    assert [len(s) for s in spans] == [4] + [1] * 15


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_backend_runs_a_tiny_deepseek_like_the_reference(tmp_path, name):
    from mlaserve import LLM, SamplingParams
    from mlaserve.testing.tiny_models import build_tiny

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
            assert abs(want[tok].logprob - have[tok].logprob) < 1e-4


def test_selector_refuses_triton_without_gpu_or_interpreter(monkeypatch):
    from mlaserve.attention.selector import select_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton_mla.*CUDA GPU"):
        select_backend(torch.device("cpu"), "triton_mla")


@pytest.mark.parametrize("loop", [{}, {"prefetch": False, "page_ahead": True}])
@pytest.mark.parametrize("block_n", [16, 32])  # 32 spans two pages of 16: the row-by-row lookup path
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantized_cache_matches_reference_on_the_same_rows(kv_dtype, block_n, loop):
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    dtype = QUANTIZED[kv_dtype]
    seq_lens, heads, page = [9, 40, 3], 16, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=7)
    rows = quantize_rows(cache, dtype)
    want, want_lse = TorchBackend().decode(q, rows, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode_tuned(
        q, rows, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=block_n, num_splits=2, **loop
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


# The tile loop's three forms: the next tile loaded into registers early (prefetch), the next tile's page looked up
# early (page_ahead, only where a tile lies inside one page), and neither.
@pytest.mark.parametrize(
    "loop", [{"prefetch": False}, {"prefetch": True}, {"prefetch": False, "page_ahead": True}]
)
@pytest.mark.parametrize("page, block_n", [(16, 16), (32, 16), (16, 32)])
def test_tiles_inside_or_across_pages(page, block_n, loop):
    """block_n dividing the page takes the one-lookup tile path; a tile spanning pages looks rows up one by one."""
    seq_lens, heads = [5, 70, 33], 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=page + block_n)
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode_tuned(
        q, cache, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=block_n, num_splits=3, **loop
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_bit_widening_is_exact_for_every_byte(kv_dtype):
    """widen_bits (integer operations) gives every one of the 256 8-bit values exactly as a conversion does."""
    from mlaserve.kvcache.quant import QUANTIZED

    x = torch.arange(256, dtype=torch.uint8).view(QUANTIZED[kv_dtype])
    y = torch.empty(256, dtype=torch.float16)
    _widen_kernel[(1,)](x, y, N=256)
    want = x.float()
    finite = want.isfinite()  # e4m3's two NaN codes have no fp16 counterpart to match
    assert torch.equal(y.float()[finite], want[finite])


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("widen_bits", [False, True])
def test_fp16_dots_and_bf16_partials_stay_close(kv_dtype, widen_bits):
    """The speed options: 8-bit tiles widened to fp16 for the dots (by conversions or by integer operations),
    partial outputs stored in bf16."""
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    seq_lens, heads, page = [9, 70, 3], 16, 16
    q, cache, table, meta = random_case(seq_lens, heads, page, seed=11)
    q = q.bfloat16()
    rows = quantize_rows(cache, QUANTIZED[kv_dtype])
    want, want_lse = TorchBackend().decode(q, rows, None, meta, 0.2, LAT, need_lse=True)
    got, lse = mla_decode_tuned(
        q, rows, table, meta.seq_lens, max(seq_lens), LAT, 0.2, block_n=16, num_splits=3,
        partial_dtype=torch.bfloat16, q_f16=True, widen_bits=widen_bits,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)


SHAPES = dict(
    batch=st.integers(1, 512),
    groups=st.integers(1, 8),
    max_len=st.integers(1, 131072),
    sms=st.sampled_from([78, 108, 132, 144]),
)


@settings(max_examples=300, deadline=None, database=None)
@given(**SHAPES, block_h=st.sampled_from([16, 32, 64]))
def test_split_rule_properties(batch, groups, max_len, sms, block_h):
    """Whatever the shape: 1 to 64 splits, no slice under 4 KV tiles, and for the memory-bound kernel (16 heads
    per program) about two programs per SM, never more splits for a bigger batch."""
    from mlaserve.kernels.mla_decode.rules import num_splits_for

    block_n = 64
    splits = num_splits_for(batch, groups, max_len, block_n, sms, block_h)
    assert 1 <= splits <= 64
    assert (splits - 1) * 4 * block_n < max_len  # a split is added only for another 4 tiles of context
    assert num_splits_for(batch + 1, groups, max_len, block_n, sms, block_h) <= splits or block_h > 16
    if block_h <= 16 and splits > 1:
        assert batch * groups * splits <= 3 * sms


@settings(max_examples=300, deadline=None, database=None)
@given(**SHAPES)
def test_fp8_dot_split_rule_properties(batch, groups, max_len, sms):
    """The fp8-dot kernel's CTA fills an SM: at most about one CTA per SM, at least 8 tiles each, at most 32 splits,
    never more splits for a bigger batch."""
    from mlaserve.kernels.mla_decode.rules import fp8_dot_splits

    splits = fp8_dot_splits(batch, groups, max_len, sms)
    tiles = -(-max_len // 64)
    assert 1 <= splits <= 32
    assert (splits - 1) * 8 < tiles  # a split is added only for another 8 tiles of context
    assert splits == 1 or batch * groups * splits <= 1.5 * sms
    assert fp8_dot_splits(batch + 1, groups, max_len, sms) <= splits


@pytest.mark.parametrize(
    ("batch", "max_len", "pays"),
    [
        (1, 8192, False),  # 16 CTAs of 8 tiles: lost on the H200
        (2, 8192, False),  # 32 of 8
        (64, 256, False),  # 64 of 4
        (4, 8192, True),  # 64 of 8 (512 tiles)
        (128, 256, True),  # 128 of 4
        (1, 32768, True),  # 32 of 16
        (64, 4096, True),
        (128, 64, False),  # one tile per CTA: never measured
    ],
)
def test_fp8_dot_kernel_rule(batch, max_len, pays):
    """The fp8-dot kernel is the default where the H200 diagnose found it faster than the widening one."""
    from mlaserve.kernels.mla_decode.rules import fp8_dot_splits, fp8_dots_pay

    splits = fp8_dot_splits(batch, 1, max_len, 132)
    assert fp8_dots_pay(batch, 1, max_len, splits) == pays


def test_gluon_kernels_are_refused_where_they_cannot_run():
    """The Gluon split kernels (Hopper only) are never picked on CPU, and naming one says what it needs. Their
    results are checked in tests/gpu."""
    q, cache, table, meta = random_case([9, 30], 64, 16, seed=3)
    default, _ = mla_decode(q, cache, table, meta.seq_lens, 30, LAT, 0.2)
    want, _ = TorchBackend().decode(q, cache, None, meta, 0.2, LAT, need_lse=True)
    torch.testing.assert_close(default, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="'gluon_wgmma' cannot run .* needs gluon"):
        mla_decode_tuned(q, cache, table, meta.seq_lens, 30, LAT, 0.2, kernel="gluon_wgmma")
    with pytest.raises(ValueError, match="'gluon_fp8' cannot run"):
        mla_decode_tuned(q, cache, table, meta.seq_lens, 30, LAT, 0.2, kernel="gluon_fp8")
    with pytest.raises(ValueError, match="'triton' takes no pdl; its tuning knobs: balanced, block_h"):
        mla_decode_tuned(q, cache, table, meta.seq_lens, 30, LAT, 0.2, pdl=False)
    with pytest.raises(ValueError, match="unknown decode kernel 'wgmma'"):
        mla_decode_tuned(q, cache, table, meta.seq_lens, 30, LAT, 0.2, kernel="wgmma")


def test_every_plan_down_the_ladder_matches_reference():
    """Each plan the decode may fall back to (dispatch.default_ladder, kernels/fit.py) at widths that are no
    multiple of a tile: 7 heads, a 40-wide latent, 16-wide rope."""
    from mlaserve.kernels.mla_decode import dispatch
    from mlaserve.kernels.mla_decode.decode import launch
    from mlaserve.kernels.mla_decode.rules import DecodeCall, DecodeShape

    lat, rope, heads, page = 40, 16, 7, 16
    seq_lens = [5, 70, 33]
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(24, page, 1, lat + rope, generator=gen)
    table = (torch.randperm(23, generator=gen)[:15] + 1).view(3, 5).int()
    q = torch.randn(len(seq_lens), heads, lat + rope, generator=gen)
    meta = build_metadata(page, table, [1] * 3, seq_lens, 3, torch.zeros(0, dtype=torch.long))
    want, want_lse = TorchBackend().decode(q, cache, None, meta, 0.2, lat, need_lse=True)
    shape = DecodeShape(heads, lat, rope, cache.dtype, q.dtype, page)
    device = dispatch.decode_device(q.device)
    rungs = dispatch.default_ladder(shape, DecodeCall(3, max(seq_lens)), device)
    assert len(rungs) > 1
    q_lat, q_pe = q[..., :lat].contiguous(), q[..., lat:].contiguous()
    for plan in rungs:
        got, lse = launch(plan, q_lat, q_pe, cache, table, meta.seq_lens, lat, 0.2)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=str(plan))
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5, msg=str(plan))
